// fp32 -> fp8 (e4m3fn, e5m2) quantization for the CPU kernels, bit-exact with torch:
//   (x.float() / scale).clamp(-max, max).to(torch.float8_e4m3fn)   (resp. float8_e5m2, max 57344)
// * bf16 -> fp32 by a 16-bit shift, fp16 -> fp32 exactly (vcvtph2ps, or the bit formula below).
// * The fp32 quotient x / scale, correctly rounded (what torch does for a Python-float scale too).
// * clamp keeps NaN (max/min operand order chosen so NaN propagates, as torch's clamp does).
// * fp32 -> fp8 is c10's rounding: integer round-to-nearest-even on the bit pattern for normals, an
//   fp32 add of a magic constant for subnormals; NaN -> 0x7F | sign. Saturation comes from the clamp.
// The scalar functions divide (quantize_one) and are the path of builds without AVX-512 or AVX2, and the
// reference the vector code is tested against (jitkv/tests/jit/test_cpu_isa.py feeds every bf16 and fp16
// value, fp32 specials and quotients at fp8 rounding edges through each path). The vector paths divide
// by none (see "Vector paths" below); their loops are instantiated per source kind (with_kind) and path.
// AVX-512: 16 lanes per conversion (32 for bf16), 64 bytes per stored line, masked lanes for the tail.
// AVX2: 8 lanes per conversion (16 for bf16), 64 bytes per stored line as two halves, then 32- and
// 8-byte steps; the last < 8 values are staged through a zeroed stack buffer (no byte masks).
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

// Vector paths: no division per value (vdivps's throughput would bound the conversion; docs/performance.md,
// CPU). With a = min(|x|, x0), where x0 is a value whose code is max's (larger |x| and inf saturate
// alike, and every intermediate stays finite), and r = RN(1 / s):
// * The quotient. s a power of two: a * r is exactly a / s and goes straight into the rounding below
//   (one FMA). Else q = RN(a * r), then Markstein's step q' = RN(q + RN(a - q * s) * r) (two FMAs),
//   which is RN(a / s) wherever q is within 1 ulp of a / s (Markstein's theorem; the residual is
//   then exact). RN(a * r) alone is only within 1.5 ulp, so fp32 sources take a first step that
//   brings q within 1 ulp. For bf16 and fp16 sources one step suffices: it gives RN(a / s) for each of
//   their 2^7 and 2^10 significands against every one of the 2^23 fp32 scale significands (checked
//   exhaustively against vdivps, once, outside the test suite; other exponents scale the quotient
//   exactly inside the range below). test_cpu_isa.py (check_fp8_quotients) compares every bf16 and
//   fp16 value, and fp32 values at the fp8 rounding edges, with torch under scales of many significands.
// * The fp8 rounding: the quotient plus a magic 2^(e + 23 - M) (e: the quotient's exponent, at least
//   the smallest normal fp8 exponent; M: fp8 mantissa bits) is the quotient rounded to nearest even at
//   fp8 precision. The magic comes before the quotient, from a's bits: the exponent of a * r is a's
//   plus r's, plus one where a's mantissa is at least the threshold t at which a * r reaches the next
//   power of two, so max(a, amin) + k1 (k1 = 2^23 - t plus the exponent offset; amin: the least a
//   whose quotient's exponent is the smallest normal fp8 one) masked to its exponent field is the
//   magic. A quotient rounded across that power of two lies within a few ulps of it, where both
//   neighbouring fp8 grids give the power of two itself.
// * The code: the magic's low mantissa bits hold the code offset of its binade, (e - emin) << M, even
//   (so ties still go to the even fp8 mantissa); the sum adds the fp8 steps above 2^e, so its low 16
//   bits are the code. bf16 sources derive a, the magic and that offset on 16-bit lanes (the top
//   halves of the fp32 values), 16 (AVX2) or 32 (AVX-512) per instruction, and take the sign byte
//   from the source words by a signed saturating pack.
// * NaN sources and scales outside [2^-85, 2^100] take the division path (quantize16_div /
//   quantize8_div) for their block or segment: below 2^-85 the residual a - q * s of a quotient near
//   half the least fp8 subnormal could underflow (inexact), and at the extremes the rounding's
//   constants leave their fields (the scale of an fp8_ds_mla tile of zeros is FLT_MIN).
struct Fp8Div {
  bool divide;               // the scale is outside [2^-85, 2^100] (or NaN): divide every value
  bool pow2;                 // the scale is a power of two: a * r is exact
  float s, r;                // the scale and RN(1 / s)
  uint32_t x0, amin, k1;     // fp32 bits: a = min(|x|, x0); magic = (max(a, amin) + k1) & 0x7f800000
  uint16_t x0h, aminh, k1h;  // the same on the top 16 bits (bf16 sources; x0 is a bf16 value)
  uint32_t c0;               // the magic's low bits: (magic >> (23 - M)) - c0 = (e - emin) << M
};

inline Fp8Div fp8_div(const Fp8Format& F, float s) {
  Fp8Div d{};
  d.s = s;
  d.divide = !(s >= 0x1p-85f && s <= 0x1p100f);
  if (d.divide) return d;
  const int m = 23 - F.shift, emin = int(F.den_below >> 23) - 127;
  d.r = 1.0f / s;
  d.pow2 = (f32_bits(s) & 0x7fffffu) == 0;
  // a / s is 2^(ea - es - 1) * (a's significand / s's) * 2, its exponent ea - es - 1 plus one where a's
  // mantissa bits are at least t = s's: adding 2^23 - t to a's bits carries into its exponent there.
  const uint32_t sb = f32_bits(s), t = sb & 0x7fffffu, th = (t + 0xffffu) >> 16;  // th: on 7 mantissa bits
  const int off = 23 - m - (int(sb >> 23) - 127) - 1;  // the magic's exponent field less a's (+ carry)
  const int et = emin + 127 - off + 23 - m;            // a's exponent field (+ carry) at e = emin
  d.k1 = (1u << 23) - t + (uint32_t(off) << 23);
  d.amin = (uint32_t(et - 1) << 23) + t;
  d.k1h = static_cast<uint16_t>(128u - th + (uint32_t(off) << 7));
  d.aminh = static_cast<uint16_t>((uint32_t(et - 1) << 7) + th);
  d.x0 = f32_bits(F.max * s) & 0xffff0000u;  // truncated to bf16: the quotient stays within 1 % of max
  d.x0h = static_cast<uint16_t>(d.x0 >> 16);
  d.c0 = uint32_t(emin + 150 - m) << m;
  return d;
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

// Fp8Format, the scale and its Fp8Div broadcast once per segment.
struct Fp8Vec {
  bool divide, pow2;
  __m512 scale, max, min;  // the division path
  __m512i emin, magic0, shift;
  __m512 r;  // the multiply path (Fp8Div)
  __m512i x0, amin, k1, c0;
  __m512i x0h, aminh, k1h, mulh, c0h;  // 16-bit lanes (bf16 sources)
  explicit Fp8Vec(const Fp8Format& F, float s) : Fp8Vec(F, fp8_div(F, s)) {}
  Fp8Vec(const Fp8Format& F, const Fp8Div& d)
      : divide(d.divide),
        pow2(d.pow2),
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

// The vector loops' paths: division (far scales), power-of-two scale, multiply and Markstein step.
enum class Fp8Path { kDivide, kPow2, kMul };

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

template <SrcKind K, Fp8Path P>
inline void quantize_seg_k(uint8_t* dst, const void* src, int64_t n, const Fp8Vec& F, bool nt) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) store_line(reinterpret_cast<char*>(dst + i), quantize64<K, P>(src, i, F), nt);
  for (; i < n; i += 16) {
    const int64_t r = n - i < 16 ? n - i : 16;
    const __mmask16 m = static_cast<__mmask16>((1u << r) - 1);
    const __m128i q = _mm512_cvtepi32_epi8(quantize16<K, P>(load16<K>(src, i, m), F));
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

// Fp8Format, the scale and its Fp8Div broadcast once per segment.
struct Fp8Vec {
  bool divide, pow2;
  __m256 scale, max, min;  // the division path
  __m256i emin, magic0, shift;
  __m256 r;  // the multiply path (Fp8Div)
  __m256i x0, amin, k1, c0;
  __m256i x0h, aminh, k1h, mulh, c0h;  // 16-bit lanes (bf16 sources)
  explicit Fp8Vec(const Fp8Format& F, float s) : Fp8Vec(F, fp8_div(F, s)) {}
  Fp8Vec(const Fp8Format& F, const Fp8Div& d)
      : divide(d.divide),
        pow2(d.pow2),
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

// The vector loops' paths: division (far scales), power-of-two scale, multiply and Markstein step.
enum class Fp8Path { kDivide, kPow2, kMul };

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
    if (__builtin_expect(!_mm256_testz_si256(nan, nan), 0)) return quantize8_div(x, F);
    return q;
  }
}

// Codes of 8 lanes -> 8 bytes in order (the low half).
JITKV_CPU_VEC __m128i pack8(__m256i q) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  return _mm_packus_epi16(w, w);
}

// 16 bf16 source words -> their 16 codes on 16-bit lanes in source order, without the sign; nan gains
// the lanes holding NaN. a, the magic and its low bits on 16-bit lanes (see "Vector paths"); the
// unpacks make the fp32 values and magics of each 128-bit lane's words 0-3 and 4-7, and the pack puts
// their codes back in order.
template <Fp8Path P>
JITKV_CPU_VEC __m256i codes16_bf16(__m256i w, const Fp8Vec& F, __m256i& nan) {
  const __m256i a = _mm256_and_si256(w, _mm256_set1_epi16(0x7fff));
  nan = _mm256_or_si256(nan, _mm256_cmpgt_epi16(a, _mm256_set1_epi16(0x7f80)));
  const __m256i ac = _mm256_min_epi16(a, F.x0h);
  const __m256i hi =
      _mm256_and_si256(_mm256_add_epi16(_mm256_max_epi16(ac, F.aminh), F.k1h), _mm256_set1_epi16(0x7f80));
  const __m256i lo = _mm256_sub_epi16(_mm256_mulhi_epu16(hi, F.mulh), F.c0h);  // hi >> (23 - M), less c0
  const __m256i z = _mm256_setzero_si256(), low16 = _mm256_set1_epi32(0xffff);
  const __m256i c0 = _mm256_and_si256(
      rounded8<SrcKind::kBF16, P>(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, ac)), _mm256_unpacklo_epi16(lo, hi), F),
      low16);
  const __m256i c1 = _mm256_and_si256(
      rounded8<SrcKind::kBF16, P>(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, ac)), _mm256_unpackhi_epi16(lo, hi), F),
      low16);
  return _mm256_packus_epi32(c0, c1);
}

// Elements [i, i+32) -> 32 bytes in order. The packs interleave 4-byte groups of the four inputs
// within each 128-bit lane; one dword permute undoes it. bf16 sources: two codes16_bf16, whose pack
// interleaves 8-byte groups of the two halves (one qword permute undoes it), and the sign bytes from a
// signed saturating pack of the source words (every negative word gives bit 7).
template <SrcKind K, Fp8Path P>
JITKV_CPU_VEC __m256i quantize32(const void* p, int64_t i, const Fp8Vec& F) {
  if constexpr (K == SrcKind::kBF16 && P != Fp8Path::kDivide) {
    const __m256i* s = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i);
    const __m256i w0 = _mm256_loadu_si256(s), w1 = _mm256_loadu_si256(s + 1);
    __m256i nan = _mm256_setzero_si256();
    const __m256i c0 = codes16_bf16<P>(w0, F, nan), c1 = codes16_bf16<P>(w1, F, nan);
    if (__builtin_expect(!_mm256_testz_si256(nan, nan), 0)) return quantize32<K, Fp8Path::kDivide>(p, i, F);
    const __m256i b = _mm256_or_si256(_mm256_packus_epi16(c0, c1),
                                      _mm256_and_si256(_mm256_packs_epi16(w0, w1), _mm256_set1_epi8(char(0x80))));
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

template <SrcKind K, Fp8Path P>
inline void quantize_seg_k(uint8_t* dst, const void* src, int64_t n, const Fp8Vec& F, bool nt) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    store_line(reinterpret_cast<char*>(dst + i), quantize32<K, P>(src, i, F), quantize32<K, P>(src, i + 32, F), nt);
  }
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

#endif

#if defined(JITKV_CPU_AVX512) || defined(JITKV_CPU_AVX2)
// The largest |x| of n source values, NaN left out (fmaxf's rule), inf kept.
inline float abs_max(SrcKind k, const void* src, int64_t n) {
  return with_kind(k, [&](auto kind) { return abs_max_k<decltype(kind)::value>(src, n); });
}

// quantize_seg for one format and scale, set up once for many segments: the vector paths' setup (the
// reciprocal, the rounding's constants and their broadcasts) costs about as much as converting 32
// values, so callers writing many short segments by one scale build it once.
class Fp8Quantizer {
 public:
  Fp8Quantizer(const Fp8Format& fmt, float scale) : v_(fmt, scale) {}

  // dst[i] = fp8(clamp(src[i] / scale)) for i < n. nt streams whole 64-byte lines (dst 64-byte
  // aligned); the rest of a partial last line is written with regular stores inside it.
  void operator()(uint8_t* dst, SrcKind k, const void* src, int64_t n, bool nt) const {
    with_kind(k, [&](auto kind) {
      constexpr SrcKind K = decltype(kind)::value;
      if (v_.divide) {
        quantize_seg_k<K, Fp8Path::kDivide>(dst, src, n, v_, nt);
      } else if (v_.pow2) {
        quantize_seg_k<K, Fp8Path::kPow2>(dst, src, n, v_, nt);
      } else {
        quantize_seg_k<K, Fp8Path::kMul>(dst, src, n, v_, nt);
      }
    });
  }

 private:
  Fp8Vec v_;
};
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

// quantize_seg for one format and scale (the vector builds' setup is worth sharing; here it is the scale).
class Fp8Quantizer {
 public:
  Fp8Quantizer(const Fp8Format& fmt, float scale) : fmt_(&fmt), scale_(scale) {}

  // dst[i] = fp8(clamp(src[i] / scale)) for i < n.
  void operator()(uint8_t* dst, SrcKind k, const void* src, int64_t n, bool) const {
    for (int64_t i = 0; i < n; ++i) dst[i] = quantize_one(load_f32(k, src, i), scale_, *fmt_);
  }

 private:
  const Fp8Format* fmt_;
  float scale_;
};
#endif

// dst[i] = fp8(clamp(src[i] / scale)) for i < n; nt: see Fp8Quantizer.
inline void quantize_seg(uint8_t* dst, SrcKind k, const void* src, int64_t n, float scale, const Fp8Format& fmt,
                         bool nt) {
  Fp8Quantizer(fmt, scale)(dst, k, src, n, nt);
}

}  // namespace cpu
}  // namespace jitkv
