// fp32 -> fp8 on the AVX2 path: the loops jitkv/cpu/fp8.h dispatches to (fp8_format.h says what they
// compute; "Vector paths" there says how). Empty unless the build targets AVX2.
#pragma once

#include <cstdint>
#include <cstring>

#include "jitkv/cpu/fp8_format.h"
#include "jitkv/cpu/row_copy.h"

#ifdef JITKV_CPU_AVX2
namespace jitkv {
namespace cpu {

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

// Fp8Format, the scale and its Fp8Div broadcast once per segment.
struct Fp8Vec {
  bool divide, pow2;
  int once_bits;           // Fp8Div::once_bits
  __m256 scale, max, min;  // the division path
  __m256i emin, magic0, shift;
  __m256 r;  // the multiply path (Fp8Div)
  __m256i x0, amin, k1, c0;
  __m256i x0h, aminh, k1h, mulh, c0h;  // 16-bit lanes (bf16 sources)
  Fp8Vec(const Fp8Format& F, float s, int once_bits) : Fp8Vec(F, fp8_div(F, s, once_bits)) {}
  Fp8Vec(const Fp8Format& F, const Fp8Div& d)
      : divide(d.divide),
        pow2(d.pow2),
        once_bits(d.once_bits),
        scale(_mm256_set1_ps(d.s)),
        max(_mm256_set1_ps(F.max)),
        min(_mm256_set1_ps(-F.max)),
        emin(_mm256_set1_epi32(int(F.den_below))),
        magic0(_mm256_set1_epi32(int(F.magic))),
        shift(_mm256_set1_epi32(F.shift)),
        r(_mm256_set1_ps(d.r)),
        x0(_mm256_set1_epi32(int(d.x0))),
        amin(_mm256_set1_epi32(int(d.amin))),
        k1(_mm256_set1_epi32(int(d.k1))),
        c0(_mm256_set1_epi32(int(d.c0))),
        x0h(_mm256_set1_epi16(short(d.x0h))),
        aminh(_mm256_set1_epi16(short(d.aminh))),
        k1h(_mm256_set1_epi16(short(d.k1h))),
        mulh(_mm256_set1_epi16(short(1 << (32 - F.shift)))),
        c0h(_mm256_set1_epi16(short(d.c0))) {}
};

// 8 lanes of quantize_one by division, one fp8 code per int32 lane: the AVX-512 quantize16_div's
// conversion (see there).
JITKV_CPU_VEC __m256i quantize8_div(__m256 x, const Fp8Vec& F) {
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

// The vector loops' paths: division (far scales), power-of-two scale, multiply and Markstein step, one
// multiply (bf16 and fp16 sources, Fp8Div::once_bits).
enum class Fp8Path { kDivide, kPow2, kMul, kOnce };

// RN(a / s) for 0 <= a <= x0 (see "Vector paths"): Markstein's step from RN(a * r), kSteps times.
template <int kSteps>
JITKV_CPU_VEC __m256 quotient8(__m256 a, const Fp8Vec& F) {
  __m256 q = _mm256_mul_ps(a, F.r);
  for (int k = 0; k < kSteps; ++k) q = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, F.scale, a), F.r, q);
  return q;
}

// a / s plus the magic, rounded once: its low 16 bits are a's code (see "Vector paths").
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC __m256i rounded8(__m256 a, __m256i magic, const Fp8Vec& F) {
  const __m256 m = _mm256_castsi256_ps(magic);
  if constexpr (P == Fp8Path::kPow2) return _mm256_castps_si256(_mm256_fmadd_ps(a, F.r, m));
  if constexpr (P == Fp8Path::kOnce) {
    static_assert(significand_bits(K) != 0, "one multiply: bf16 and fp16 sources (Fp8Div::once_bits)");
    __m256 q = _mm256_mul_ps(a, F.r);
    asm("" : "+x"(q));  // RN(a * r) rounded on its own: the compiler may not fuse it into the add
    return _mm256_castps_si256(_mm256_add_ps(q, m));
  }
  return _mm256_castps_si256(_mm256_add_ps(quotient8<K == SrcKind::kF32 ? 2 : 1>(a, F), m));
}

// 8 lanes of quantize_one by multiplication (P: kPow2 or kMul), one fp8 code per int32 lane; nan
// gains the lanes holding NaN, whose codes are not.
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC __m256i quantize8_mul(__m256 x, const Fp8Vec& F, __m256i& nan) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i a = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  nan = _mm256_or_si256(nan, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)));
  const __m256i ac = _mm256_min_epi32(a, F.x0);
  const __m256i hi =
      _mm256_and_si256(_mm256_add_epi32(_mm256_max_epi32(ac, F.amin), F.k1), _mm256_set1_epi32(0x7f800000));
  const __m256i magic = _mm256_or_si256(hi, _mm256_sub_epi32(_mm256_srlv_epi32(hi, F.shift), F.c0));
  const __m256i code = _mm256_and_si256(rounded8<K, P>(_mm256_castsi256_ps(ac), magic, F), _mm256_set1_epi32(0x7f));
  return _mm256_or_si256(code, _mm256_srli_epi32(_mm256_xor_si256(bits, a), 24));  // the sign bit to bit 7
}

// 8 lanes of quantize_one, one fp8 code per int32 lane, on path P.
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC __m256i quantize8(__m256 x, const Fp8Vec& F) {
  if constexpr (P == Fp8Path::kDivide) {
    return quantize8_div(x, F);
  } else {
    __m256i nan = _mm256_setzero_si256();
    const __m256i q = quantize8_mul<K, P>(x, F, nan);
    // A mask's sign bits by one vmovmskps: vptest is two µops, one on the shuffle port.
    if (__builtin_expect(_mm256_movemask_ps(_mm256_castsi256_ps(nan)) != 0, 0)) return quantize8_div(x, F);
    return q;
  }
}

// Codes of 8 lanes -> 8 bytes in order (the low half).
JITKV_CPU_VEC __m128i pack8(__m256i q) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  return _mm_packus_epi16(w, w);
}

// 16 bf16 source magnitudes (the words less their sign) -> their 16 codes on 16-bit lanes, each 128-bit
// lane's in the order of its words 0, 4, 1, 5, 2, 6, 3, 7. The magic and its low bits on 16-bit lanes
// (see "Vector paths"); the unpacks make the fp32 values and magics of each lane's words 0-3 and 4-7,
// and one blend puts the low word of each result side by side (quantize32 restores the order).
template <Fp8Path P>
JITKV_CPU_VEC __m256i codes16_bf16(__m256i a, const Fp8Vec& F) {
  const __m256i ac = _mm256_min_epi16(a, F.x0h);
  const __m256i hi =
      _mm256_and_si256(_mm256_add_epi16(_mm256_max_epi16(ac, F.aminh), F.k1h), _mm256_set1_epi16(0x7f80));
  const __m256i lo = _mm256_sub_epi16(_mm256_mulhi_epu16(hi, F.mulh), F.c0h);  // hi >> (23 - M), less c0
  const __m256i z = _mm256_setzero_si256();
  const __m256i c0 =
      rounded8<SrcKind::kBF16, P>(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, ac)), _mm256_unpacklo_epi16(lo, hi), F);
  const __m256i c1 =
      rounded8<SrcKind::kBF16, P>(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, ac)), _mm256_unpackhi_epi16(lo, hi), F);
  return _mm256_blend_epi16(c0, _mm256_slli_epi32(c1, 16), 0xaa);
}

// Elements [i, i+32) -> 32 bytes in order. The packs interleave 4-byte groups of the four inputs
// within each 128-bit lane; one dword permute undoes it. bf16 sources: a NaN anywhere sends the 32 to
// the division; two codes16_bf16, whose pack interleaves 8-byte groups of the two halves with each
// group's bytes in codes16_bf16's order (a byte shuffle and a qword permute undo both), and the sign
// bytes from a signed saturating pack of the source words (every negative word gives bit 7).
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC __m256i quantize32(const void* p, int64_t i, const Fp8Vec& F) {
  if constexpr (K == SrcKind::kBF16 && P != Fp8Path::kDivide) {
    const __m256i* s = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i);
    const __m256i w0 = _mm256_loadu_si256(s), w1 = _mm256_loadu_si256(s + 1);
    const __m256i mag = _mm256_set1_epi16(0x7fff);
    const __m256i a0 = _mm256_and_si256(w0, mag), a1 = _mm256_and_si256(w1, mag);
    const __m256i nan = _mm256_cmpgt_epi16(_mm256_max_epi16(a0, a1), _mm256_set1_epi16(0x7f80));
    // vpmovmskb rather than vptest, as quantize8's test.
    if (__builtin_expect(_mm256_movemask_epi8(nan) != 0, 0)) return quantize32<K, Fp8Path::kDivide>(p, i, F);
    const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,  //
                                           0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const __m256i codes =
        _mm256_shuffle_epi8(_mm256_packus_epi16(codes16_bf16<P>(a0, F), codes16_bf16<P>(a1, F)), order);
    const __m256i b =
        _mm256_or_si256(codes, _mm256_and_si256(_mm256_packs_epi16(w0, w1), _mm256_set1_epi8(char(0x80))));
    return _mm256_permute4x64_epi64(b, 0xd8);
  } else {
    const __m256i w01 = _mm256_packus_epi32(quantize8<K, P>(load8<K>(p, i), F), quantize8<K, P>(load8<K>(p, i + 8), F));
    const __m256i w23 =
        _mm256_packus_epi32(quantize8<K, P>(load8<K>(p, i + 16), F), quantize8<K, P>(load8<K>(p, i + 24), F));
    return _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
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

// Elements [0, n) -> n bytes, n a multiple of 64: whole lines, no tail (quantize_seg_k's main loop).
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC void quantize_lines_k(uint8_t* dst, const void* src, int64_t n, const Fp8Vec& F, bool nt) {
  for (int64_t i = 0; i < n; i += 64) {
    store_line(reinterpret_cast<char*>(dst + i), quantize32<K, P>(src, i, F), quantize32<K, P>(src, i + 32, F), nt);
  }
}

template <SrcKind K, Fp8Path P>
inline void quantize_seg_k(uint8_t* dst, const void* src, int64_t n, const Fp8Vec& F, bool nt) {
  int64_t i = n / 64 * 64;
  quantize_lines_k<K, P>(dst, src, i, F, nt);
  if (i + 32 <= n) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), quantize32<K, P>(src, i, F));
    i += 32;
  }
  for (; i + 8 <= n; i += 8) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), pack8(quantize8<K, P>(load8<K>(src, i), F)));
  }
  if (i < n) {
    alignas(8) uint8_t codes[8];
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), pack8(quantize8<K, P>(load_part<K>(src, i, n - i), F)));
    std::memcpy(dst + i, codes, static_cast<size_t>(n - i));
  }
}

}  // namespace cpu
}  // namespace jitkv
#endif  // JITKV_CPU_AVX2
