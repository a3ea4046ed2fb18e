// fp32 -> fp8 (e4m3fn, e5m2) quantization for the CPU kernels, bit-exact with torch:
//   (x.float() / scale).clamp(-max, max).to(torch.float8_e4m3fn)   (resp. float8_e5m2, max 57344)
// * bf16 -> fp32 by a 16-bit shift, fp16 -> fp32 exactly (vcvtph2ps, or the bit formula below).
// * Division in fp32 by the fp32 scale (what torch does for a Python-float scale too).
// * clamp keeps NaN (max/min operand order chosen so NaN propagates, as torch's clamp does).
// * fp32 -> fp8 is c10's rounding: integer round-to-nearest-even on the bit pattern for normals, an
//   fp32 add of a magic constant for subnormals; NaN -> 0x7F | sign. Saturation comes from the clamp.
// AVX-512: 16 lanes per conversion, 64 bytes per stored line, masked lanes for the tail; the scalar
// functions are the non-AVX-512 build's path (and the reference the vector code is tested against).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "jitkv/cpu/row_copy.h"

namespace jitkv {
namespace cpu {

// Constants of c10's fp32 -> fp8 rounding. The format is a runtime value (one code path for both).
struct Fp8Format {
  float max;           // saturation bound used by the clamp
  uint32_t ovf_at;     // |x| bit patterns >= this are NaN / inf
  uint32_t den_below;  // |x| bit patterns < this become fp8 subnormals
  uint32_t magic;      // subnormal rounding: bits(|x| + magic) - magic
  uint32_t bias;       // normal rounding: (|x| + bias + odd) >> shift
  int shift;           // 23 - mantissa bits
  uint32_t inf_code;   // overflowing non-NaN input (unreachable after the clamp)
};
constexpr Fp8Format kFp8E4M3{448.0f, 1087u << 20, 121u << 23, 141u << 23, (uint32_t(7 - 127) << 23) + 0x7ffffu, 20, 0x7f};
constexpr Fp8Format kFp8E5M2{57344.0f, 143u << 23, 113u << 23, 134u << 23, (uint32_t(15 - 127) << 23) + 0xfffffu, 21,
                             0x7c};

// Source element kind: a runtime value; the per-16-lane switch on it is loop-invariant (predicted)
// and next to the division's cost, free. One instantiation serves all sources.
enum class SrcKind { kBF16, kF16, kF32 };

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {  // zero / subnormal: mant * 2^-24 is exact in fp32
    return f32_from_bits(sign | f32_bits(float(mant) * 5.9604644775390625e-08f));
  }
  return f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

inline uint8_t fp32_to_fp8(float f, const Fp8Format& F) {
  uint32_t bits = f32_bits(f);
  uint32_t sign = bits & 0x80000000u, a = bits ^ sign, r;
  if (a >= F.ovf_at) {
    r = a > 0x7f800000u ? 0x7f : F.inf_code;
  } else if (a < F.den_below) {
    r = f32_bits(f32_from_bits(a) + f32_from_bits(F.magic)) - F.magic;
  } else {
    r = (a + F.bias + ((a >> F.shift) & 1)) >> F.shift;
  }
  return static_cast<uint8_t>(r | (sign >> 24));
}

inline uint8_t quantize_one(float x, float scale, const Fp8Format& F) {
  float y = x / scale;
  y = y < -F.max ? -F.max : y;  // NaN compares false: kept
  y = y > F.max ? F.max : y;
  return fp32_to_fp8(y, F);
}

// Element i of a source row as fp32.
inline float load_f32(SrcKind k, const void* p, int64_t i) {
  switch (k) {
    case SrcKind::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case SrcKind::kF16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

#ifdef JITKV_CPU_AVX512
// Elements [i, i+16) (lanes in m) of a source row as fp32.
inline __m512 load16(SrcKind k, const void* p, int64_t i, __mmask16 m) {
  switch (k) {
    case SrcKind::kBF16: {
      __m256i h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case SrcKind::kF16:
      return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i)));
    default: return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  }
}

// Fp8Format and scale broadcast once per segment.
struct Fp8Vec {
  __m512 scale, max, min;
  __m512i den_below, magic, bias;
  __m128i shift;
  Fp8Vec(const Fp8Format& F, float s)
      : scale(_mm512_set1_ps(s)), max(_mm512_set1_ps(F.max)), min(_mm512_set1_ps(-F.max)),
        den_below(_mm512_set1_epi32(int(F.den_below))), magic(_mm512_set1_epi32(int(F.magic))),
        bias(_mm512_set1_epi32(int(F.bias))), shift(_mm_cvtsi32_si128(F.shift)) {}
};

// 16 lanes of quantize_one, one fp8 code per int32 lane. After the clamp the only inputs at or above
// ovf_at are NaNs, whose normal-path codes all exceed 0x7f (checked over every NaN pattern) while
// finite codes stay below (0x7e for 448, 0x7b for 57344): one unsigned min maps NaN to 0x7f.
inline __m512i quantize16(SrcKind k, const void* p, int64_t i, __mmask16 m, const Fp8Vec& F) {
  __m512 y = _mm512_div_ps(load16(k, p, i, m), F.scale);
  // max/min return their SECOND operand when either is NaN: keep y there so NaN propagates.
  y = _mm512_min_ps(F.max, _mm512_max_ps(F.min, y));
  __m512i bits = _mm512_castps_si512(y);
  __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  __m512i odd = _mm512_and_si512(_mm512_srl_epi32(a, F.shift), _mm512_set1_epi32(1));
  __m512i r = _mm512_srl_epi32(_mm512_add_epi32(_mm512_add_epi32(a, F.bias), odd), F.shift);
  __m512i dn = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(F.magic))), F.magic);
  r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(a, F.den_below), dn);
  r = _mm512_min_epu32(r, _mm512_set1_epi32(0x7f));
  // r | (sign bit moved to bit 7): ternary logic A | (B & C).
  return _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xF8);
}

// 64 lanes -> 64 bytes in order. The two packs interleave 4-byte groups across the four inputs
// within each 128-bit lane (a 4x4 dword transpose); one permute undoes it.
inline __m512i quantize64(SrcKind k, const void* p, int64_t i, const Fp8Vec& F) {
  const __mmask16 all = 0xffff;
  __m512i lo = _mm512_packus_epi32(quantize16(k, p, i, all, F), quantize16(k, p, i + 16, all, F));
  __m512i hi = _mm512_packus_epi32(quantize16(k, p, i + 32, all, F), quantize16(k, p, i + 48, all, F));
  __m512i bytes = _mm512_packus_epi16(lo, hi);
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), bytes);
}
#endif

// The largest |x| of n source values, NaN left out (fmaxf's rule), inf kept.
inline float abs_max(SrcKind k, const void* src, int64_t n) {
#ifdef JITKV_CPU_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t r = n - i < 16 ? n - i : 16;
    const __m512 a = _mm512_abs_ps(load16(k, src, i, static_cast<__mmask16>((1u << r) - 1)));
    acc = _mm512_max_ps(a, acc);  // max returns its second operand when either is NaN: a NaN lane keeps acc
  }
  return _mm512_reduce_max_ps(acc);
#else
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(load_f32(k, src, i));
    m = a > m ? a : m;  // NaN compares false: left out
  }
  return m;
#endif
}

// dst[i] = fp8(clamp(src[i] / scale)) for i < n. nt streams whole 64-byte lines (dst 64-byte aligned).
inline void quantize_seg(uint8_t* dst, SrcKind k, const void* src, int64_t n, float scale, const Fp8Format& fmt,
                         bool nt) {
#ifdef JITKV_CPU_AVX512
  const Fp8Vec F(fmt, scale);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) store_line(reinterpret_cast<char*>(dst + i), quantize64(k, src, i, F), nt);
  for (; i < n; i += 16) {
    int64_t r = n - i < 16 ? n - i : 16;
    __mmask16 m = static_cast<__mmask16>((1u << r) - 1);
    __m128i q = _mm512_cvtepi32_epi8(quantize16(k, src, i, m, F));
    _mm512_mask_storeu_epi8(dst + i, __mmask64(m), _mm512_castsi128_si512(q));
  }
#else
  (void)nt;
  for (int64_t i = 0; i < n; ++i) dst[i] = quantize_one(load_f32(k, src, i), scale, fmt);
#endif
}

}  // namespace cpu
}  // namespace jitkv
