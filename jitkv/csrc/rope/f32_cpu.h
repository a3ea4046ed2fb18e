// Float32 rows for the rope CPU kernel (rope_cpu.cpp): a row of bf16 / fp16 / fp32 loaded as float32, and
// a float32 row stored rounded to nearest even into bf16 or fp16 (or copied into fp32), torch's rounding
// (NaN stays a NaN; its payload is not specified). AVX-512 or AVX2 where built (jitkv/cpu/isa.h: 16 or 8
// lanes, masked or scalar tails), scalar otherwise. On AVX2 also a whole 16-bit head rotated from its
// source into its row in one pass (rope_row16, rope_normed_row16).
#pragma once

#include <cstdint>
#include <cstring>

#include "jitkv/cpu/fp8.h"
#include "jitkv/cpu/isa.h"

namespace jitkv {
namespace rope {

using cpu::SrcKind;

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = cpu::f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// fp32 -> fp16, round to nearest even (the scalar builds' path; the vector builds use vcvtps2ph).
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = cpu::f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504: inf
  if (a < 0x38800000u) {  // fp16 subnormal or zero: add a magic whose ulp is 2^-24 (the hardware rounds)
    const float m = cpu::f32_from_bits(a) + 0.5f;
    return static_cast<uint16_t>(sign | (cpu::f32_bits(m) - 0x3f000000u));
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1) - (112u << 23);
  return static_cast<uint16_t>(sign | (r >> 13));
}

// dst[0, n) = float32(src[0, n)) of kind k.
inline void load_row(float* dst, SrcKind k, const char* src, int64_t n) {
#if defined(JITKV_CPU_AVX512)
  cpu::with_kind(k, [&](auto kind) {
    constexpr SrcKind K = decltype(kind)::value;
    // Whole vectors by plain stores: a masked store forwards nothing to the loads that read the row
    // next (the norm, the rotation), which then wait for it to reach the cache (docs/performance.md
    // "rope CPU masked stores").
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, cpu::load16<K>(src, i, static_cast<__mmask16>(0xffff)));
    if (i < n) {
      const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
      _mm512_mask_storeu_ps(dst + i, m, cpu::load16<K>(src, i, m));
    }
  });
#elif defined(JITKV_CPU_AVX2)
  cpu::with_kind(k, [&](auto kind) {
    constexpr SrcKind K = decltype(kind)::value;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, cpu::load8<K>(src, i));
    if (i < n) {
      alignas(32) float part[8];
      _mm256_store_ps(part, cpu::load_part<K>(src, i, n - i));
      std::memcpy(dst + i, part, static_cast<size_t>(n - i) * 4);
    }
  });
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = cpu::load_f32(k, src, i);
#endif
}

#if defined(JITKV_CPU_AVX512)
inline __m256i bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}
#elif defined(JITKV_CPU_AVX2)
inline __m128i bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

// dst[0, n) = src[0, n) rounded to nearest even into kind k (bf16, fp16) or copied (fp32).
inline void store_row(char* dst, SrcKind k, const float* src, int64_t n) {
  if (k == SrcKind::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return;
  }
  auto* out = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(JITKV_CPU_AVX512)
  const auto half16 = [k](__m512 v) {
    return k == SrcKind::kBF16 ? bf16x16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  };
  // 32 values a store: two conversions joined in a register, where a conversion stored by itself compiles
  // to its memory form (vpmovdw / vcvtps2ph to memory), which Zen 4 runs far slower than the register form
  // and a store (docs/performance.md "rope CPU 16-bit stores").
  for (; i + 32 <= n; i += 32) {
    const __m256i lo = half16(_mm512_loadu_ps(src + i)), hi = half16(_mm512_loadu_ps(src + i + 16));
    _mm512_storeu_si512(out + i, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
  }
  for (; i < n; i += 16) {
    const int64_t r = n - i < 16 ? n - i : 16;
    const __mmask16 m = static_cast<__mmask16>((1u << r) - 1);
    _mm256_mask_storeu_epi16(out + i, m, half16(_mm512_maskz_loadu_ps(m, src + i)));
  }
#elif defined(JITKV_CPU_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    const __m128i h = k == SrcKind::kBF16 ? bf16x8(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
#endif
  for (; i < n; ++i) out[i] = k == SrcKind::kBF16 ? f32_to_bf16(src[i]) : f32_to_f16(src[i]);
}

// Whether rope_row16 takes a head of d values of kind k: an AVX2 build, 16-bit values, d a multiple of 16.
// AVX-512 and scalar builds take the three passes (load_row, rotate, store_row: docs/performance.md "rope
// CPU rows in one pass").
inline bool row16_takes(SrcKind k, int64_t d) {
#if defined(JITKV_CPU_AVX2)
  return k != SrcKind::kF32 && d % 16 == 0;
#else
  (void)k, (void)d;
  return false;
#endif
}

#if defined(JITKV_CPU_AVX2)
// out[0, d) = rope of the values load(i) gives 8 at a time, rounded to nearest even into kind K (bf16,
// fp16): rotate's arithmetic and store_row's rounding.
template <SrcKind K, class Load>
void rope_row16_k(uint16_t* out, const float* C, const float* S, int64_t d, bool neox, Load load) {
  const auto store8 = [&](int64_t i, __m256 v) {
    const __m128i h = K == SrcKind::kBF16 ? bf16x8(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  };
  if (neox) {
    const int64_t h = d / 2;
    for (int64_t i = 0; i < h; i += 8) {
      const __m256 a = load(i), b = load(h + i);
      const __m256 c = _mm256_loadu_ps(C + i), sn = _mm256_loadu_ps(S + h + i);  // S: [-s | s]
      store8(i, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, sn)));
      store8(h + i, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, sn)));
    }
    return;
  }
  for (int64_t i = 0; i < d; i += 8) {  // 4 pairs: the partner vector swaps adjacent lanes
    const __m256 v = load(i);
    const __m256 a = _mm256_mul_ps(v, _mm256_loadu_ps(C + i));
    const __m256 b = _mm256_mul_ps(_mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)), _mm256_loadu_ps(S + i));
    store8(i, _mm256_add_ps(a, b));
  }
}
#endif

// A head of d 16-bit values of kind k (row16_takes) rotated over all d dims from src into dst (dst ==
// src allowed) in one pass through registers: load_row's, rotate's and store_row's arithmetic and
// rounding, so the same bytes, without the float32 row between them (docs/performance.md "rope CPU rows
// in one pass"). C, S: the expanded cos/sin row (rotate).
inline void rope_row16(char* dst, const char* src, SrcKind k, const float* C, const float* S, int64_t d, bool neox) {
#if defined(JITKV_CPU_AVX2)
  cpu::with_kind(k, [&](auto kind) {
    constexpr SrcKind K = decltype(kind)::value;
    if constexpr (K != SrcKind::kF32) {
      rope_row16_k<K>(reinterpret_cast<uint16_t*>(dst), C, S, d, neox,
                      [&](int64_t i) { return cpu::load8<K>(src, i); });
    }
  });
#else
  (void)dst, (void)src, (void)k, (void)C, (void)S, (void)d, (void)neox;
#endif
}

// rope_row16 of a normed head: x its float32 values, each scaled as (x * r) * w before the rotation (the
// norm's last step), in the same pass.
inline void rope_normed_row16(char* dst, const float* x, float r, const float* w, SrcKind k, const float* C,
                              const float* S, int64_t d, bool neox) {
#if defined(JITKV_CPU_AVX2)
  const __m256 rv = _mm256_set1_ps(r);
  cpu::with_kind(k, [&](auto kind) {
    constexpr SrcKind K = decltype(kind)::value;
    if constexpr (K != SrcKind::kF32) {
      rope_row16_k<K>(reinterpret_cast<uint16_t*>(dst), C, S, d, neox, [&](int64_t i) {
        return _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i));
      });
    }
  });
#else
  (void)dst, (void)x, (void)r, (void)w, (void)k, (void)C, (void)S, (void)d, (void)neox;
#endif
}

}  // namespace rope
}  // namespace jitkv
