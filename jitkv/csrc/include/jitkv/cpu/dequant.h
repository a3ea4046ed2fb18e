// fp8 (e4m3fn, e5m2) -> bf16 for the CPU gathers: bf16(float(x) * scale), bit-exact with the torch
// reference and the CUDA kernels.
// * fp8 -> fp32 exactly: e5m2 is the high byte of an fp16; e4m3's exponent and mantissa bits, moved up
//   by 7, are an fp16 of the value / 2^8 (normals and subnormals alike), its sign to bit 15; e4m3's
//   0x7F / 0xFF are NaN. The vector paths convert those fp16s with vcvtph2ps; the scalar path (and
//   the vector paths' tails) reads a 256-entry table.
// * times the scale in fp32, then bf16 rounded to nearest even, NaN as 0x7FFF (the GPU's conversion).
// AVX-512: 16 values per step; AVX2 (F16C): 8.
#pragma once

#include <cmath>
#include <cstdint>

#include "jitkv/codes.h"
#include "jitkv/cpu/fp8.h"
#include "jitkv/cpu/isa.h"

namespace jitkv {
namespace cpu {

using codes::KvFormat;  // the per-tensor fp8 formats a gather decodes: kE4M3, kE5M2

// The value of every fp8 byte.
struct Fp8Table {
  float v[256];
  explicit Fp8Table(KvFormat f) {
    for (uint32_t b = 0; b < 256; ++b) {
      v[b] = f == KvFormat::kE5M2 ? f16_to_f32(static_cast<uint16_t>(b << 8)) : e4m3(b);
    }
  }
  static float e4m3(uint32_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u, sign = (b & 0x80u) << 24;
    if ((b & 0x7Fu) == 0x7Fu) return f32_from_bits(0x7FC00000u | sign);
    const float mag = e == 0 ? static_cast<float>(m) * 0.001953125f  // m * 2^-9
                             : f32_from_bits(((e + 120u) << 23) | (m << 20));
    return f32_from_bits(f32_bits(mag) | sign);
  }
};

inline uint16_t bf16_rne(float f) {
  const uint32_t b = f32_bits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

#ifdef JITKV_CPU_AVX512
// 16 fp8 bytes -> 16 floats, exact (see the top of the file).
JITKV_CPU_VEC __m512 fp8x16_to_f32(const uint8_t* src, KvFormat f) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  if (f == KvFormat::kE5M2) return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(b, 8)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i h =
      _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 8), _mm512_slli_epi32(mag, 7));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_set1_ps(256.0f));
  return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), _mm512_set1_ps(NAN));
}

// bf16_rne of 16 floats.
JITKV_CPU_VEC __m256i bf16x16_rne(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FFF));
  return _mm512_cvtepi32_epi16(r);
}

#elif defined(JITKV_CPU_AVX2)
// 8 fp8 bytes -> 8 floats, exact (see the top of the file), in 16-bit lanes: an e4m3 NaN byte gets
// the all-ones fp16 exponent, so its fp16 is a NaN too.
JITKV_CPU_VEC __m256 fp8x8_to_f32(const uint8_t* src, KvFormat f) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  if (f == KvFormat::kE5M2) return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
  const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7F));
  const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7C00));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m128i h = _mm_or_si128(_mm_or_si128(sign, _mm_slli_epi16(mag, 7)), nan);
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

// bf16_rne of 8 floats.
JITKV_CPU_VEC __m128i bf16x8_rne(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FFF), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // r <= 0xFFFF: exact
}
#endif

// dst[i] = bf16(value(src[i]) * scale), i < n; table: Fp8Table(f).v.
inline void dequant(uint16_t* dst, const uint8_t* src, int64_t n, KvFormat f, const float* table, float scale) {
  int64_t i = 0;
#ifdef JITKV_CPU_AVX512
  const __m512 s = _mm512_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bf16x16_rne(_mm512_mul_ps(fp8x16_to_f32(src + i, f), s)));
  }
#elif defined(JITKV_CPU_AVX2)
  const __m256 s = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bf16x8_rne(_mm256_mul_ps(fp8x8_to_f32(src + i, f), s)));
  }
#else
  (void)f;
#endif
  for (; i < n; ++i) dst[i] = bf16_rne(table[src[i]] * scale);
}

}  // namespace cpu
}  // namespace jitkv
