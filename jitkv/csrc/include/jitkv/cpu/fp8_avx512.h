// fp32 -> fp8 on the AVX-512 path: the loops jitkv/cpu/fp8.h dispatches to (fp8_format.h says what they
// compute; "Vector paths" there says how). Empty unless the build targets AVX-512.
#pragma once

#include <cstdint>
#include <cstring>

#include "jitkv/cpu/fp8_format.h"
#include "jitkv/cpu/row_copy.h"

#ifdef JITKV_CPU_AVX512
namespace jitkv {
namespace cpu {

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

// Fp8Format, the scale and its Fp8Div broadcast once per segment.
struct Fp8Vec {
  bool divide, pow2;
  int once_bits;           // Fp8Div::once_bits
  __m512 scale, max, min;  // the division path
  __m512i emin, magic0, shift;
  __m512 r;  // the multiply path (Fp8Div)
  __m512i x0, amin, k1, c0;
  __m512i x0h, aminh, k1h, mulh, c0h;  // 16-bit lanes (bf16 sources)
  Fp8Vec(const Fp8Format& F, float s, int once_bits) : Fp8Vec(F, fp8_div(F, s, once_bits)) {}
  Fp8Vec(const Fp8Format& F, const Fp8Div& d)
      : divide(d.divide),
        pow2(d.pow2),
        once_bits(d.once_bits),
        scale(_mm512_set1_ps(d.s)),
        max(_mm512_set1_ps(F.max)),
        min(_mm512_set1_ps(-F.max)),
        emin(_mm512_set1_epi32(int(F.den_below))),
        magic0(_mm512_set1_epi32(int(F.magic))),
        shift(_mm512_set1_epi32(F.shift)),
        r(_mm512_set1_ps(d.r)),
        x0(_mm512_set1_epi32(int(d.x0))),
        amin(_mm512_set1_epi32(int(d.amin))),
        k1(_mm512_set1_epi32(int(d.k1))),
        c0(_mm512_set1_epi32(int(d.c0))),
        x0h(_mm512_set1_epi16(short(d.x0h))),
        aminh(_mm512_set1_epi16(short(d.aminh))),
        k1h(_mm512_set1_epi16(short(d.k1h))),
        mulh(_mm512_set1_epi16(short(1 << (32 - F.shift)))),
        c0h(_mm512_set1_epi16(short(d.c0))) {}
};

// 16 lanes of quantize_one by division, one fp8 code per int32 lane (the path of NaN sources and far
// scales). Both of c10's roundings as one fp32 add: |y| plus 2^(e + shift), e = |y|'s exponent but at
// least the smallest normal fp8 exponent, has its last bit where the fp8 value's is, so the sum is |y|
// rounded to nearest even (c10's subnormal magic is the case e = that smallest exponent). The sum's
// bits minus the magic's count fp8 steps above 2^e; adding e's offset from the smallest normal
// exponent, shifted to the exponent field, gives the code. NaN's sum (a NaN) lies below the magic, so
// the difference wraps past 0x7f and one unsigned min maps it to 0x7f; finite codes stay below (0x7e
// for 448, 0x7b for 57344).
JITKV_CPU_VEC __m512i quantize16_div(__m512 x, const Fp8Vec& F) {
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

// The vector loops' paths: division (far scales), power-of-two scale, multiply and Markstein step, one
// multiply (bf16 and fp16 sources, Fp8Div::once_bits).
enum class Fp8Path { kDivide, kPow2, kMul, kOnce };

// RN(a / s) for 0 <= a <= x0 (see "Vector paths"): Markstein's step from RN(a * r), kSteps times.
template <int kSteps>
JITKV_CPU_VEC __m512 quotient16(__m512 a, const Fp8Vec& F) {
  __m512 q = _mm512_mul_ps(a, F.r);
  for (int k = 0; k < kSteps; ++k) q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, F.scale, a), F.r, q);
  return q;
}

// a / s plus the magic, rounded once: its low 16 bits are a's code (see "Vector paths").
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC __m512i rounded16(__m512 a, __m512i magic, const Fp8Vec& F) {
  const __m512 m = _mm512_castsi512_ps(magic);
  if constexpr (P == Fp8Path::kPow2) return _mm512_castps_si512(_mm512_fmadd_ps(a, F.r, m));
  if constexpr (P == Fp8Path::kOnce) {
    static_assert(significand_bits(K) != 0, "one multiply: bf16 and fp16 sources (Fp8Div::once_bits)");
    __m512 q = _mm512_mul_ps(a, F.r);
    asm("" : "+v"(q));  // RN(a * r) rounded on its own: the compiler may not fuse it into the add
    return _mm512_castps_si512(_mm512_add_ps(q, m));
  }
  return _mm512_castps_si512(_mm512_add_ps(quotient16<K == SrcKind::kF32 ? 2 : 1>(a, F), m));
}

// 16 lanes of quantize_one by multiplication (P: kPow2 or kMul), one fp8 code per int32 lane; nan:
// the lanes holding NaN, whose codes are not.
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC __m512i quantize16_mul(__m512 x, const Fp8Vec& F, __mmask16& nan) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
  const __m512i ac = _mm512_min_epu32(a, F.x0);
  const __m512i hi =
      _mm512_and_si512(_mm512_add_epi32(_mm512_max_epu32(ac, F.amin), F.k1), _mm512_set1_epi32(0x7f800000));
  const __m512i magic = _mm512_or_si512(hi, _mm512_sub_epi32(_mm512_srlv_epi32(hi, F.shift), F.c0));
  const __m512i sum = rounded16<K, P>(_mm512_castsi512_ps(ac), magic, F);
  // The code is the sum's bits 0-6 (at most 0x7e), the sign bit 7 of bits >> 24: ternary logic A ? B : C.
  return _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x7f), sum, _mm512_srli_epi32(bits, 24), 0xCA);
}

// 16 lanes of quantize_one, one fp8 code per int32 lane, on path P.
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC __m512i quantize16(__m512 x, const Fp8Vec& F) {
  if constexpr (P == Fp8Path::kDivide) {
    return quantize16_div(x, F);
  } else {
    __mmask16 nan;
    const __m512i q = quantize16_mul<K, P>(x, F, nan);
    if (__builtin_expect(nan != 0, 0)) return quantize16_div(x, F);
    return q;
  }
}

// 32 bf16 source words -> their 32 codes on 16-bit lanes in source order, without the sign; nan: the
// lanes holding NaN are added. a, the magic and its low bits on 16-bit lanes (see "Vector paths");
// the unpacks make the fp32 values and magics of each 128-bit lane's words 0-3 and 4-7, and the pack
// puts their codes back in order.
template <Fp8Path P>
JITKV_CPU_VEC __m512i codes32_bf16(__m512i w, const Fp8Vec& F, __mmask32& nan) {
  const __m512i a = _mm512_and_si512(w, _mm512_set1_epi16(0x7fff));
  nan |= _mm512_cmpgt_epi16_mask(a, _mm512_set1_epi16(0x7f80));
  const __m512i ac = _mm512_min_epi16(a, F.x0h);
  const __m512i hi =
      _mm512_and_si512(_mm512_add_epi16(_mm512_max_epi16(ac, F.aminh), F.k1h), _mm512_set1_epi16(0x7f80));
  const __m512i lo = _mm512_sub_epi16(_mm512_mulhi_epu16(hi, F.mulh), F.c0h);  // hi >> (23 - M), less c0
  const __m512i z = _mm512_setzero_si512(), low16 = _mm512_set1_epi32(0xffff);
  const __m512i c0 = _mm512_and_si512(
      rounded16<SrcKind::kBF16, P>(_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, ac)), _mm512_unpacklo_epi16(lo, hi), F),
      low16);
  const __m512i c1 = _mm512_and_si512(
      rounded16<SrcKind::kBF16, P>(_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, ac)), _mm512_unpackhi_epi16(lo, hi), F),
      low16);
  return _mm512_packus_epi32(c0, c1);
}

// 64 lanes -> 64 bytes in order. The two packs interleave 4-byte groups across the four inputs
// within each 128-bit lane (a 4x4 dword transpose); one permute undoes it. bf16 sources: two
// codes32_bf16, whose pack interleaves 8-byte groups of the two halves (one permute undoes it), and the
// sign bytes from a signed saturating pack of the source words (every negative word gives bit 7).
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC __m512i quantize64(const void* p, int64_t i, const Fp8Vec& F) {
  if constexpr (K == SrcKind::kBF16 && P != Fp8Path::kDivide) {
    const uint16_t* s = static_cast<const uint16_t*>(p) + i;
    const __m512i w0 = _mm512_loadu_si512(s), w1 = _mm512_loadu_si512(s + 32);
    __mmask32 nan = 0;
    const __m512i c0 = codes32_bf16<P>(w0, F, nan), c1 = codes32_bf16<P>(w1, F, nan);
    if (__builtin_expect(nan != 0, 0)) return quantize64<K, Fp8Path::kDivide>(p, i, F);
    const __m512i b = _mm512_ternarylogic_epi32(_mm512_packus_epi16(c0, c1), _mm512_packs_epi16(w0, w1),
                                                _mm512_set1_epi8(char(0x80)), 0xF8);  // A | (B & C)
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), b);
  } else {
    const __mmask16 all = 0xffff;
    const __m512i lo =
        _mm512_packus_epi32(quantize16<K, P>(load16<K>(p, i, all), F), quantize16<K, P>(load16<K>(p, i + 16, all), F));
    const __m512i hi = _mm512_packus_epi32(quantize16<K, P>(load16<K>(p, i + 32, all), F),
                                           quantize16<K, P>(load16<K>(p, i + 48, all), F));
    const __m512i bytes = _mm512_packus_epi16(lo, hi);
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), bytes);
  }
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

// Elements [0, n) -> n bytes, n a multiple of 64: whole lines, no tail (quantize_seg_k's main loop).
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC void quantize_lines_k(uint8_t* dst, const void* src, int64_t n, const Fp8Vec& F, bool nt) {
  for (int64_t i = 0; i < n; i += 64) store_line(reinterpret_cast<char*>(dst + i), quantize64<K, P>(src, i, F), nt);
}

template <SrcKind K, Fp8Path P>
inline void quantize_seg_k(uint8_t* dst, const void* src, int64_t n, const Fp8Vec& F, bool nt) {
  int64_t i = n / 64 * 64;
  quantize_lines_k<K, P>(dst, src, i, F, nt);
  for (; i < n; i += 16) {
    const int64_t r = n - i < 16 ? n - i : 16;
    const __mmask16 m = static_cast<__mmask16>((1u << r) - 1);
    const __m128i q = _mm512_cvtepi32_epi8(quantize16<K, P>(load16<K>(src, i, m), F));
    _mm512_mask_storeu_epi8(dst + i, __mmask64(m), _mm512_castsi128_si512(q));
  }
}

}  // namespace cpu
}  // namespace jitkv
#endif  // JITKV_CPU_AVX512
