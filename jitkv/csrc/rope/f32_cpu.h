// Float32 rows for the rope CPU kernel (rope_cpu.cpp): a row of bf16 / fp16 / fp32 loaded as float32, and
// a float32 row stored rounded to nearest even into bf16 or fp16 (or copied into fp32), torch's rounding
// (NaN stays a NaN; its payload is not specified). AVX-512 or AVX2 where built (jitkv/cpu/isa.h: 16 or 8
// lanes, masked or scalar tails), scalar otherwise.
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

}  // namespace rope
}  // namespace jitkv
