// fp32 -> fp8 (e4m3fn, e5m2) quantization for the CPU kernels, bit-exact with torch:
//   (x.float() / scale).clamp(-max, max).to(torch.float8_e4m3fn)   (resp. float8_e5m2, max 57344)
// * bf16 -> fp32 by a 16-bit shift, fp16 -> fp32 exactly (vcvtph2ps, or the bit formula below).
// * Division in fp32 by the fp32 scale (what torch does for a Python-float scale too).
// * clamp keeps NaN (max/min operand order chosen so NaN propagates, as torch's clamp does).
// * fp32 -> fp8 is c10's rounding: integer round-to-nearest-even on the bit pattern for normals, an
//   fp32 add of a magic constant for subnormals; NaN -> 0x7F | sign. Saturation comes from the clamp.
//   The vector paths do both roundings as one fp32 add whose magic follows the value's exponent
//   (quantize16 / quantize8): fewer instructions than the integer form and its select.
// AVX-512: 16 lanes per conversion, 64 bytes per stored line, masked lanes for the tail. AVX2: 8 lanes
// per conversion, 64 bytes per stored line as two halves, then 32- and 8-byte steps; the last < 8
// values are staged through a zeroed stack buffer (no byte masks). The loops are instantiated per
// source kind (with_kind). The scalar functions are the path of builds without
// either (and the reference the vector code is tested against: jitkv/tests/jit/test_cpu_isa.py
// feeds every bf16 and fp16 value and fp32 specials through each path).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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
constexpr Fp8Format kFp8E4M3{448.0f, 1087u << 20, 121u << 23, 141u << 23, (uint32_t(7 - 127) << 23) + 0x7ffffu,
                             20,     0x7f};
constexpr Fp8Format kFp8E5M2{57344.0f, 143u << 23, 113u << 23, 134u << 23, (uint32_t(15 - 127) << 23) + 0xfffffu,
                             21,       0x7c};

// Source element kind: a runtime value; the vector paths dispatch on it once per segment.
enum class SrcKind { kBF16, kF16, kF32 };

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

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
    case SrcKind::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case SrcKind::kF16:
      return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// f(std::integral_constant<SrcKind, k>{}): the vector loops are instantiated per source kind, so the
// kind is decided once per segment, not per vector.
template <class F>
inline auto with_kind(SrcKind k, F&& f) {
  switch (k) {
    case SrcKind::kBF16:
      return f(std::integral_constant<SrcKind, SrcKind::kBF16>{});
    case SrcKind::kF16:
      return f(std::integral_constant<SrcKind, SrcKind::kF16>{});
    default:
      return f(std::integral_constant<SrcKind, SrcKind::kF32>{});
  }
}

#ifdef JITKV_CPU_AVX512
// Elements [i, i+16) (lanes in m) of a source row as fp32.
template <SrcKind K>
JITKV_CPU_VEC __m512 load16(const void* p, int64_t i, __mmask16 m) {
  if constexpr (K == SrcKind::kF32) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  } else {
    const __m256i h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i));
    if constexpr (K == SrcKind::kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Fp8Format and scale broadcast once per segment.
struct Fp8Vec {
  __m512 scale, max, min;
  __m512i emin, magic0, shift;
  Fp8Vec(const Fp8Format& F, float s)
      : scale(_mm512_set1_ps(s)),
        max(_mm512_set1_ps(F.max)),
        min(_mm512_set1_ps(-F.max)),
        emin(_mm512_set1_epi32(int(F.den_below))),
        magic0(_mm512_set1_epi32(int(F.magic))),
        shift(_mm512_set1_epi32(F.shift)) {}
};

// 16 lanes of quantize_one, one fp8 code per int32 lane. Both of c10's roundings as one fp32 add: |y|
// plus 2^(e + shift), e = |y|'s exponent but at least the smallest normal fp8 exponent, has its last
// bit where the fp8 value's is, so the sum is |y| rounded to nearest even (c10's subnormal magic is
// the case e = that smallest exponent). The sum's bits minus the magic's count fp8 steps above 2^e;
// adding e's offset from the smallest normal exponent, shifted to the exponent field, gives the code.
// NaN's sum (a NaN) lies below the magic, so the difference wraps past 0x7f and one unsigned min maps
// it to 0x7f; finite codes stay below (0x7e for 448, 0x7b for 57344).
JITKV_CPU_VEC __m512i quantize16(__m512 x, const Fp8Vec& F) {
  __m512 y = _mm512_div_ps(x, F.scale);
  // max/min return their SECOND operand when either is NaN: keep y there so NaN propagates.
  y = _mm512_min_ps(F.max, _mm512_max_ps(F.min, y));
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  // e's exponent field above the smallest normal fp8 exponent's (den_below), >= 0.
  const __m512i de = _mm512_max_epi32(_mm512_sub_epi32(_mm512_and_si512(a, _mm512_set1_epi32(0x7f800000)), F.emin),
                                      _mm512_setzero_si512());
  const __m512i magic = _mm512_add_epi32(de, F.magic0);
  const __m512i sum = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(magic)));
  __m512i r = _mm512_add_epi32(_mm512_sub_epi32(sum, magic), _mm512_srlv_epi32(de, F.shift));
  r = _mm512_min_epu32(r, _mm512_set1_epi32(0x7f));
  // r | (sign bit moved to bit 7): ternary logic A | (B & C).
  return _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xF8);
}

// 64 lanes -> 64 bytes in order. The two packs interleave 4-byte groups across the four inputs
// within each 128-bit lane (a 4x4 dword transpose); one permute undoes it.
template <SrcKind K>
JITKV_CPU_VEC __m512i quantize64(const void* p, int64_t i, const Fp8Vec& F) {
  const __mmask16 all = 0xffff;
  const __m512i lo = _mm512_packus_epi32(quantize16(load16<K>(p, i, all), F), quantize16(load16<K>(p, i + 16, all), F));
  const __m512i hi =
      _mm512_packus_epi32(quantize16(load16<K>(p, i + 32, all), F), quantize16(load16<K>(p, i + 48, all), F));
  const __m512i bytes = _mm512_packus_epi16(lo, hi);
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), bytes);
}

template <SrcKind K>
inline float abs_max_k(const void* src, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t r = n - i < 16 ? n - i : 16;
    const __m512 a = _mm512_abs_ps(load16<K>(src, i, static_cast<__mmask16>((1u << r) - 1)));
    acc = _mm512_max_ps(a, acc);  // max returns its second operand when either is NaN: a NaN lane keeps acc
  }
  return _mm512_reduce_max_ps(acc);
}

template <SrcKind K>
inline void quantize_seg_k(uint8_t* dst, const void* src, int64_t n, const Fp8Vec& F, bool nt) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) store_line(reinterpret_cast<char*>(dst + i), quantize64<K>(src, i, F), nt);
  for (; i < n; i += 16) {
    const int64_t r = n - i < 16 ? n - i : 16;
    const __mmask16 m = static_cast<__mmask16>((1u << r) - 1);
    const __m128i q = _mm512_cvtepi32_epi8(quantize16(load16<K>(src, i, m), F));
    _mm512_mask_storeu_epi8(dst + i, __mmask64(m), _mm512_castsi128_si512(q));
  }
}

#elif defined(JITKV_CPU_AVX2)
// Elements [i, i+8) of a source row as fp32.
template <SrcKind K>
JITKV_CPU_VEC __m256 load8(const void* p, int64_t i) {
  if constexpr (K == SrcKind::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (K == SrcKind::kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Elements [i, i+r) of a source row, 0 < r < 8, as fp32 lanes; the other lanes are 0.
template <SrcKind K>
JITKV_CPU_VEC __m256 load_part(const void* p, int64_t i, int64_t r) {
  constexpr int64_t es = K == SrcKind::kF32 ? 4 : 2;
  alignas(32) char buf[32] = {};
  std::memcpy(buf, static_cast<const char*>(p) + i * es, static_cast<size_t>(r * es));
  return load8<K>(buf, 0);
}

// Fp8Format and scale broadcast once per segment.
struct Fp8Vec {
  __m256 scale, max, min;
  __m256i emin, magic0, shift;
  Fp8Vec(const Fp8Format& F, float s)
      : scale(_mm256_set1_ps(s)),
        max(_mm256_set1_ps(F.max)),
        min(_mm256_set1_ps(-F.max)),
        emin(_mm256_set1_epi32(int(F.den_below))),
        magic0(_mm256_set1_epi32(int(F.magic))),
        shift(_mm256_set1_epi32(F.shift)) {}
};

// 8 lanes of quantize_one, one fp8 code per int32 lane: the AVX-512 quantize16's conversion (see there).
JITKV_CPU_VEC __m256i quantize8(__m256 x, const Fp8Vec& F) {
  __m256 y = _mm256_div_ps(x, F.scale);
  // max/min return their SECOND operand when either is NaN: keep y there so NaN propagates.
  y = _mm256_min_ps(F.max, _mm256_max_ps(F.min, y));
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i a = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  // e's exponent field above the smallest normal fp8 exponent's (den_below), >= 0.
  const __m256i de = _mm256_max_epi32(_mm256_sub_epi32(_mm256_and_si256(a, _mm256_set1_epi32(0x7f800000)), F.emin),
                                      _mm256_setzero_si256());
  const __m256i magic = _mm256_add_epi32(de, F.magic0);
  const __m256i sum = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic)));
  __m256i r = _mm256_add_epi32(_mm256_sub_epi32(sum, magic), _mm256_srlv_epi32(de, F.shift));
  r = _mm256_min_epu32(r, _mm256_set1_epi32(0x7f));
  return _mm256_or_si256(r, _mm256_srli_epi32(_mm256_xor_si256(bits, a), 24));  // the sign bit to bit 7
}

// Codes of 8 lanes -> 8 bytes in order (the low half).
JITKV_CPU_VEC __m128i pack8(__m256i q) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  return _mm_packus_epi16(w, w);
}

// Elements [i, i+32) -> 32 bytes in order. The packs interleave 4-byte groups of the four inputs
// within each 128-bit lane; one dword permute undoes it.
template <SrcKind K>
JITKV_CPU_VEC __m256i quantize32(const void* p, int64_t i, const Fp8Vec& F) {
  const __m256i w01 = _mm256_packus_epi32(quantize8(load8<K>(p, i), F), quantize8(load8<K>(p, i + 8), F));
  const __m256i w23 = _mm256_packus_epi32(quantize8(load8<K>(p, i + 16), F), quantize8(load8<K>(p, i + 24), F));
  return _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <SrcKind K>
inline float abs_max_k(const void* src, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  // max returns its second operand when either is NaN: a NaN lane keeps acc.
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(_mm256_andnot_ps(sign, load8<K>(src, i)), acc);
  if (i < n) acc = _mm256_max_ps(_mm256_andnot_ps(sign, load_part<K>(src, i, n - i)), acc);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

template <SrcKind K>
inline void quantize_seg_k(uint8_t* dst, const void* src, int64_t n, const Fp8Vec& F, bool nt) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    store_line(reinterpret_cast<char*>(dst + i), quantize32<K>(src, i, F), quantize32<K>(src, i + 32, F), nt);
  }
  if (i + 32 <= n) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), quantize32<K>(src, i, F));
    i += 32;
  }
  for (; i + 8 <= n; i += 8) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), pack8(quantize8(load8<K>(src, i), F)));
  }
  if (i < n) {
    alignas(8) uint8_t codes[8];
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), pack8(quantize8(load_part<K>(src, i, n - i), F)));
    std::memcpy(dst + i, codes, static_cast<size_t>(n - i));
  }
}

#endif

#if defined(JITKV_CPU_AVX512) || defined(JITKV_CPU_AVX2)
// The largest |x| of n source values, NaN left out (fmaxf's rule), inf kept.
inline float abs_max(SrcKind k, const void* src, int64_t n) {
  return with_kind(k, [&](auto kind) { return abs_max_k<decltype(kind)::value>(src, n); });
}

// dst[i] = fp8(clamp(src[i] / scale)) for i < n. nt streams whole 64-byte lines (dst 64-byte aligned);
// the rest of a partial last line is written with regular stores inside it.
inline void quantize_seg(uint8_t* dst, SrcKind k, const void* src, int64_t n, float scale, const Fp8Format& fmt,
                         bool nt) {
  const Fp8Vec F(fmt, scale);
  with_kind(k, [&](auto kind) { quantize_seg_k<decltype(kind)::value>(dst, src, n, F, nt); });
}
#else
// The largest |x| of n source values, NaN left out (fmaxf's rule), inf kept.
inline float abs_max(SrcKind k, const void* src, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(load_f32(k, src, i));
    m = a > m ? a : m;  // NaN compares false: left out
  }
  return m;
}

// dst[i] = fp8(clamp(src[i] / scale)) for i < n.
inline void quantize_seg(uint8_t* dst, SrcKind k, const void* src, int64_t n, float scale, const Fp8Format& fmt, bool) {
  for (int64_t i = 0; i < n; ++i) dst[i] = quantize_one(load_f32(k, src, i), scale, fmt);
}
#endif

}  // namespace cpu
}  // namespace jitkv
