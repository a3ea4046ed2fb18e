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

#include <dlpack/dlpack.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "jitkv/codes.h"
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

// The constants of a cache format's fp8 bytes: e5m2 for codes::KvFormat kE5M2, e4m3 for kE4M3 (and the
// fp8_ds_mla tiles).
inline const Fp8Format& fp8_format(codes::KvFormat f) { return f == codes::KvFormat::kE5M2 ? kFp8E5M2 : kFp8E4M3; }

// Source element kind: a runtime value; the vector paths dispatch on it once per segment.
enum class SrcKind { kBF16, kF16, kF32 };

// The kind of a bf16, fp16 or fp32 tensor's elements (the parsers have checked the dtype).
inline SrcKind src_kind(DLDataType d) {
  return d.code == kDLBfloat ? SrcKind::kBF16 : d.bits == 16 ? SrcKind::kF16 : SrcKind::kF32;
}

// The kind of a codes::SrcDtype (BF16, F16, F32; the parsers give no other).
inline SrcKind src_kind(codes::SrcDtype d) {
  return d == codes::SrcDtype::kBF16 ? SrcKind::kBF16 : d == codes::SrcDtype::kF16 ? SrcKind::kF16 : SrcKind::kF32;
}

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
// * One multiply for bf16 and fp16 sources (Fp8Div::once_bits, asked for by quantizers that convert
//   many values of one kind): RN(a * r) and RN(a / s) lie within 2 ulps of each other, and the
//   rounding below gives both the same code unless an fp8 midpoint of some binade lies among the fp32
//   values from one to the other. a's 2^7 (bf16) or 2^10 (fp16, its subnormals included: their fp32
//   values have no more significant bits) significands m give the quotients' significands (other
//   exponents scale both exactly), so one check of the pairs RN(m * r), RN(m / s) against every
//   midpoint pattern (products_round_alike) tells whether RN(a * r), rounded on its own and then with
//   the magic, gives every such a the code of the exact quotient; a scale that fails it (7.0 and
//   448 / 1.5 do for bf16: their quotients meet midpoints) keeps Markstein's step.
// * NaN sources and scales outside [2^-85, 2^100] take the division path (quantize16_div /
//   quantize8_div) for their block or segment: below 2^-85 the residual a - q * s of a quotient near
//   half the least fp8 subnormal could underflow (inexact), and at the extremes the rounding's
//   constants leave their fields (the scale of an fp8_ds_mla tile of zeros is FLT_MIN).
struct Fp8Div {
  bool divide;               // the scale is outside [2^-85, 2^100] (or NaN): divide every value
  bool pow2;                 // the scale is a power of two: a * r is exact
  int once_bits;             // sources of this many significand bits (bf16 7, fp16 10; 0: none) take
                             // one multiply: RN(a * r) gives RN(a / s)'s code (products_round_alike)
  float s, r;                // the scale and RN(1 / s)
  uint32_t x0, amin, k1;     // fp32 bits: a = min(|x|, x0); magic = (max(a, amin) + k1) & 0x7f800000
  uint16_t x0h, aminh, k1h;  // the same on the top 16 bits (bf16 sources; x0 is a bf16 value)
  uint32_t c0;               // the magic's low bits: (magic >> (23 - M)) - c0 = (e - emin) << M
};

// 1 where an fp32 value is a midpoint between neighbouring fp8 values of some binade, of either format: its
// bits below p are 1 then zeros for some p from e4m3's 20 (23 less 3 mantissa bits) to 23 (the
// subnormal binades), or its significand is 1.0 (the midpoint of the least subnormal step, p = 24).
inline uint32_t fp8_midpoint_bits(uint32_t v) {
  return uint32_t((v & 0xfffffu) == 0x80000u) | uint32_t((v & 0x1fffffu) == 0x100000u) |
         uint32_t((v & 0x3fffffu) == 0x200000u) | uint32_t((v & 0x7fffffu) == 0x400000u) |
         uint32_t((v & 0x7fffffu) == 0);
}

// The significand bits of a source kind's values (fp32: none that one multiply is checked for).
constexpr int significand_bits(SrcKind k) { return k == SrcKind::kBF16 ? 7 : k == SrcKind::kF16 ? 10 : 0; }

// For each significand m of `bits` bits: RN(m * r) and RN(m / s) are equal, or at most 2 ulps apart with
// no fp8 midpoint among the values from one to the other ("Vector paths": one multiply). Branch-free, so
// that the compiler vectorizes it.
inline bool products_round_alike_exact(float s, float r, int bits) {
  uint32_t bad = 0;
  const float step = 1.0f / float(1 << bits);
  for (int j = 0; j < (1 << bits); ++j) {
    const float m = 1.0f + float(j) * step;
    const uint32_t p = f32_bits(m * r), q = f32_bits(m / s);
    const uint32_t lo = p < q ? p : q, ulps = (p < q ? q : p) - lo;
    const uint32_t mid =
        fp8_midpoint_bits(lo) | fp8_midpoint_bits(lo + 1) | (uint32_t(ulps == 2) & fp8_midpoint_bits(lo + 2));
    bad |= uint32_t(ulps != 0) & (uint32_t(ulps > 2) | mid);
  }
  return bad == 0;
}

// products_round_alike_exact, remembered per scale and significand width for the calling thread: a
// model's scales (per layer, per head) recur in every step, and the check costs about as much as
// converting 1,000 values for bf16, 8,000 for fp16 (0.11-0.16 µs and about 1 µs on an Intel Xeon at
// about 2 GHz, AVX-512 / AVX2 builds; docs/performance.md "One multiply").
inline bool products_round_alike(float s, float r, int bits) {
  struct Seen {
    uint32_t s;
    int bits;
    bool alike;
  };
  thread_local Seen seen[1024] = {};
  const uint32_t sb = f32_bits(s);
  Seen& e = seen[((sb ^ uint32_t(bits)) * 2654435761u) >> 22];
  if (e.bits != bits || e.s != sb) e = {sb, bits, products_round_alike_exact(s, r, bits)};
  return e.alike;
}

// once_bits: the significand bits of the values the caller converts many of by this scale (a call's
// rows, not one tile's; significand_bits of their kind), so that the check for one multiply pays; 0:
// no check.
inline Fp8Div fp8_div(const Fp8Format& F, float s, int once_bits = 0) {
  Fp8Div d{};
  d.s = s;
  d.divide = !(s >= 0x1p-85f && s <= 0x1p100f);
  if (d.divide) return d;
  const int m = 23 - F.shift, emin = int(F.den_below >> 23) - 127;
  d.r = 1.0f / s;
  d.pow2 = (f32_bits(s) & 0x7fffffu) == 0;
  d.once_bits = once_bits != 0 && !d.pow2 && products_round_alike(s, d.r, once_bits) ? once_bits : 0;
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

}  // namespace cpu
}  // namespace jitkv
