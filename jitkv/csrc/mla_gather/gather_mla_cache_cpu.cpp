// gather_mla_cache on CPU: out[t] = the cache entry of output row t (gather_mla_cache.cuh), copied or
// dequantized to bf16.
//
// Algorithm: parse + validate (gather_mla_cache.cuh, its host part); check cu_seq_lens serially
// (non-decreasing, rows inside out: ValueError / IndexError before any write, as the reference does
// on CPU); then one pass over the output rows, OpenMP above a payload threshold: each row finds its
// entry with the same rule as the CUDA kernel (entry_offset) and is copied (row_copy.h) or
// dequantized: fp8 -> fp32 exactly (AVX-512: 16 values through vcvtph2ps; the scalar tail and
// non-AVX-512 builds through a 256-entry table), times the scale in fp32, rounded to bf16 (nearest
// even; NaN as 0x7FFF, the GPU's conversion).
#include <tvm/ffi/function.h>

#include <cmath>
#include <cstring>

#include "jitkv/cpu/fp8.h"
#include "jitkv/cpu/isa.h"
#include "jitkv/cpu/row_copy.h"
#include "jitkv/cpu/scatter.h"
#include "mla_gather/gather_mla_cache.cuh"

namespace jitkv {
namespace {

using namespace mla_gather;

constexpr const char* kOp = "gather_mla_cache";

// The value of every fp8 byte (e4m3fn: 0x7F / 0xFF NaN; e5m2: the high byte of an fp16).
struct Fp8Table {
  float v[256];
  explicit Fp8Table(Format f) {
    for (uint32_t b = 0; b < 256; ++b) v[b] = f == kFp8E5M2 ? cpu::f16_to_f32(static_cast<uint16_t>(b << 8)) : e4m3(b);
  }
  static float e4m3(uint32_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u, sign = (b & 0x80u) << 24;
    if ((b & 0x7Fu) == 0x7Fu) return cpu::f32_from_bits(0x7FC00000u | sign);
    const float mag = e == 0 ? static_cast<float>(m) * 0.001953125f  // m * 2^-9
                             : cpu::f32_from_bits(((e + 120u) << 23) | (m << 20));
    return cpu::f32_from_bits(cpu::f32_bits(mag) | sign);
  }
};

inline uint16_t bf16_rne(float f) {
  const uint32_t b = cpu::f32_bits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

#ifdef JITKV_CPU_AVX512
// 16 fp8 bytes -> 16 floats, exact: e5m2 is the high byte of an fp16; e4m3's exponent and mantissa
// bits, moved up by 7, are an fp16 of the value / 2^8 (normals and subnormals alike), its sign to
// bit 15; 0x7F / 0xFF are NaN.
inline __m512 fp8x16_to_f32(const uint8_t* src, Format f) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  if (f == kFp8E5M2) return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(b, 8)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i h = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 8),
                                    _mm512_slli_epi32(mag, 7));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_set1_ps(256.0f));
  return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), _mm512_set1_ps(NAN));
}

// bf16_rne of 16 floats.
inline __m256i bf16x16_rne(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FFF));
  return _mm512_cvtepi32_epi16(r);
}
#endif

// dst[i] = bf16(value(src[i]) * scale), i < n.
inline void dequant(uint16_t* dst, const uint8_t* src, int64_t n, Format f, const float* table, float scale) {
  int64_t i = 0;
#ifdef JITKV_CPU_AVX512
  const __m512 s = _mm512_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bf16x16_rne(_mm512_mul_ps(fp8x16_to_f32(src + i, f), s)));
  }
#else
  (void)f;
#endif
  for (; i < n; ++i) dst[i] = bf16_rne(table[src[i]] * scale);
}

void write_row(const GatherParams& p, char* dst, int64_t off, const float* table, float scale) {
  if (off < 0) {
    std::memset(dst, 0, static_cast<size_t>(p.out_row_bytes));
    return;
  }
  const char* src = p.cache + off;
  auto* d = reinterpret_cast<uint16_t*>(dst);
  const auto* s = reinterpret_cast<const uint8_t*>(src);
  switch (p.format) {
    case kCopy:
      cpu::copy_seg(dst, src, p.out_row_bytes, false);
      break;
    case kDsMla:
      for (int t = 0; t < DsMla::kNope / DsMla::kTile; ++t) {
        float tile_scale;
        std::memcpy(&tile_scale, src + DsMla::kScaleAt + 4 * t, 4);
        dequant(d + t * DsMla::kTile, s + t * DsMla::kTile, DsMla::kTile, kFp8E4M3, table, tile_scale);
      }
      std::memcpy(d + DsMla::kNope, src + DsMla::kRopeAt, 2 * DsMla::kRope);
      break;
    default:
      dequant(d, s, p.out_row_bytes / 2, static_cast<Format>(p.format), table, scale);
  }
}

// cu_seq_lens must describe rows of out (the strict check of reference.check_gather_rows).
void check_rows(const GatherParams& p) {
  int64_t prev = 0;
  for (int64_t r = 0; r <= p.num_reqs; ++r) {
    const int64_t v = load_index(p.cu_seq_lens, r, p.cu_i64);
    if (r > 0 && v < prev) {
      TVM_FFI_THROW(ValueError) << kOp << ": cu_seq_lens: expected non-decreasing values, got " << prev << " then "
                                << v << " at positions " << r - 1 << ", " << r;
    }
    prev = v;
  }
  const int64_t first = load_index(p.cu_seq_lens, 0, p.cu_i64);
  if (first < 0) {
    TVM_FFI_THROW(IndexError) << kOp << ": cu_seq_lens: request 0 starts at row " << first << ", below row 0 of out";
  }
  if (prev > p.rows) {
    TVM_FFI_THROW(IndexError) << kOp << ": cu_seq_lens: the requests end at row " << prev << ", past out's " << p.rows
                              << " rows";
  }
}

void gather_mla_cache_cpu(TensorView out, TensorView kv_cache, TensorView block_table, TensorView cu_seq_lens,
                          Optional<TensorView> seq_starts, int64_t format, Optional<TensorView> scale,
                          double scale_value) {
  if (out.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << kOp << ": out: expected a CPU tensor for the CPU kernel, got "
                              << device_str(out.device());
  }
  const GatherParams p =
      parse_params(kOp, out, kv_cache, block_table, cu_seq_lens, seq_starts, format, scale, scale_value);
  check_rows(p);
  if (p.rows == 0 || p.num_reqs == 0) return;
  const float s = p.scale_ptr ? *p.scale_ptr : p.scale_value;
  if (!(s > 0.0f && s <= 3.4028234663852886e38f)) {  // a CPU scale tensor is read here, like a float
    TVM_FFI_THROW(ValueError) << kOp << ": scale: must be finite and > 0, got " << s;
  }
  static const Fp8Table e4m3(kFp8E4M3), e5m2(kFp8E5M2);
  const float* table = (p.format == kFp8E5M2 ? e5m2 : e4m3).v;
  const int threads = cpu::threads_for(p.rows * p.out_row_bytes);
  cpu::for_rows(p.rows, threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t off = entry_offset(p, t);
      if (off != kNotWritten) write_row(p, p.out + t * p.out_row_stride, off, table, s);
    }
  });
}

}  // namespace
}  // namespace jitkv

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gather_mla_cache, jitkv::gather_mla_cache_cpu);
JITKV_CPU_EXPORT_ISA();
