// fp8 quantization of the CUDA writers: stored = fp8(x / scale), the quotient correctly rounded in
// fp32, then converted with round-to-nearest-even; finite overflow and +-inf saturate to +-max (the
// bytes of clamp(-max, max) first) and NaN gives 0x7F: torch's (x.float() / scale).clamp(-max,
// max).to(float8) on the GPU (docs/design.md §4).
//  - the division, one object per scale, x / scale as div(x):
//    - Divider: exact and branch-free, for a lone warp's short chain (the latency kernels);
//    - RnDivider: __fdiv_rn, a range check and a branch per value, fewer registers (the bulk kernels);
//    - Pow2Divider: x * 2^-e, exact, for the power-of-two (ue8m0) scales of the DeepSeek-V4 and indexer
//      records (ue8m0_inverse, ue8m0_scale, ue8m0_ceil), and a power-of-two scale in the rope kernels
//      (with_divider: Pow2Divider or Divider by the scale's bits);
//  - fp8x2 / fp8x4 / fp8_byte: the conversion; quantize / quantize8: N source values (cuda/src.cuh) ->
//    N bytes, in the order (QuantizeOrder) each writer was tuned with;
//  - vec_amax_no_nan: a 16-byte vector's largest 16-bit magnitude, NaN left out; amax_scale: a tile's
//    scale max(amax / fp8_max, FLT_MIN) from its amax, exact and branch-free.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "jitkv/codes.h"
#include "jitkv/cuda/src.cuh"

namespace jitkv {
namespace cuda {

// Division by one scale, for an fp8 conversion, with no branch: div(x) is __fdiv_rn's own fast path
// (r = rcp.approx(s) refined by one Newton step, q = x * r, q' = q + r * (x - q * s), the residual
// entering negated so that x = -0 keeps its sign) without its per-element range check. __fdiv_rn's
// result is the correctly rounded quotient wherever no intermediate over- or underflows; for a scale
// with 2^-80 <= s < 2^100 the other cases give the same fp8 byte:
//  - |x * r| >= 2^128: q = +-inf and q' NaN; div returns q, saturated to +-max like the true
//    quotient (at least 2^127 in magnitude). x = +-inf likewise; x NaN stays NaN.
//  - |x| < 2^-103 (the residual may round): |x / s| < 2^-23 and q' within a few ulps of it, both
//    below half the smallest subnormal of e4m3 (2^-9) and e5m2 (2^-16): +-0 with x's sign.
// Any other finite scale > 0 is brought into that window by a power of two f (2^100 below it, 2^-100
// above it, 1 inside), which multiplies x too: x * f / (scale * f) is x / scale, and where x * f is
// not exact the fp8 byte is still the true quotient's: x * 2^100 overflows only where |x / scale| >=
// 2^128 / 2^20 (saturated; div(+-inf) is +-inf), and x * 2^-100 rounds only below 2^-126, where
// |x / scale| < 2^-126 (scale * f >= 1) gives +-0. scale = +inf (an fp8_ds_mla tile holding an
// infinity) takes f = 0 and a finite s: +-0 for finite x, NaN for +-inf, as __fdiv_rn. The window
// test and both scaled products run side by side, so the reciprocal waits for two selects more than
// the bare one, and there is no branch (against a window test and a branch to __fdiv_rn:
// docs/performance.md "Divider"). A scale that is not finite and > 0 otherwise (a device scale is not
// checked unless JITKV_DEBUG=1) gives unspecified codes. The CUDA tests feed every bf16 and fp16 value
// through each writer at scales on both sides of the window.
struct Divider {
  float f;      // multiplies x: the power of two that brings the scale into the window (1 inside it)
  float s, r;   // the scale times f (finite) and its refined reciprocal
  float scale;  // as given (RnDivider by it: the bulk kernels)

  Divider() = default;
  __device__ __forceinline__ explicit Divider(float scale_) : scale(scale_) {
    const float a = fabsf(scale_);
    const bool below = a < 0x1p-80f, above = a >= 0x1p100f;  // NaN: neither
    // scale * f from products formed beside the window test (+inf: 2^100, any finite value serves)
    const float up = __fmul_rn(scale_, 0x1p100f), down = fminf(__fmul_rn(scale_, 0x1p-100f), 0x1p100f);
    s = below ? up : above ? down : scale_;
    f = below ? 0x1p100f : !above ? 1.0f : a == __int_as_float(0x7f800000) ? 0.0f : 0x1p-100f;
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(s));
    r = __fmaf_rn(r0, __fmaf_rn(r0, -s, 1.0f), r0);
  }

  // fp32 x / scale, correctly rounded wherever its fp8 byte depends on it (see above).
  __device__ __forceinline__ float operator()(float x) const {
    x = __fmul_rn(x, f);
    const float q = __fmul_rn(x, r);
    const float refined = __fmaf_rn(-r, __fmaf_rn(q, s, -x), q);
    return fabsf(q) == __int_as_float(0x7f800000) ? q : refined;
  }
};

// x / scale by __fdiv_rn: correctly rounded for every scale, a range check and a branch per value.
struct RnDivider {
  float scale;
  __device__ __forceinline__ float operator()(float x) const { return __fdiv_rn(x, scale); }
};

// x / 2^e as x * 2^-e (`inv`): exact wherever the quotient is a normal float, and where it is not
// (below 2^-126) far below half the smallest fp8 subnormal either way.
struct Pow2Divider {
  float inv;
  __device__ __forceinline__ float operator()(float x) const { return __fmul_rn(x, inv); }
};

// UE8M0 scales: a byte b is the scale 2^(b - 127) (b = 0: the denormal 2^-127; 255: inf).
__device__ __forceinline__ float ue8m0_scale(uint32_t b) { return __uint_as_float(b ? b << 23 : 0x00400000u); }

// 2^(127 - b), the multiplier of Pow2Divider for the byte b; 255 (the UE8M0 NaN code) gives 2^-128.
__device__ __forceinline__ float ue8m0_inverse(uint32_t b) {
  return __uint_as_float(b == 255 ? 0x00200000u : (254u - b) << 23);
}

// The smallest power of two >= a finite s > 0 (exponent + 1 when the mantissa is not zero), exact.
__device__ __forceinline__ float ue8m0_ceil(float s) {
  return __uint_as_float((__float_as_uint(s) + 0x7FFFFFu) & 0x7F800000u);
}

// f(div) with div dividing by `scale`: a Pow2Divider where the scale is a power of two whose reciprocal
// is a normal float (2^-126 <= scale <= 2^126; x * 2^-e gives x / 2^e's fp8 byte, see Pow2Divider),
// else a Divider. One multiply per value instead of Divider's five; for a per-tensor scale the branch
// goes the same way in every thread, and f's code is there twice.
template <class F>
__device__ __forceinline__ void with_divider(float scale, F&& f) {
  const uint32_t b = __float_as_uint(scale);
  const uint32_t e = b >> 23;  // the exponent field (a negative scale: >= 256)
  if ((b & 0x7FFFFFu) == 0 && e >= 1 && e <= 253) {
    f(Pow2Divider{ue8m0_inverse(e)});
  } else {
    f(Divider(scale));
  }
}

// The interpretation a cache format stores (fp8_ds_mla: e4m3).
constexpr __nv_fp8_interpretation_t fp8_interp(codes::KvFormat f) {
  return f == codes::KvFormat::kE5M2 ? __NV_E5M2 : __NV_E4M3;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 890
// Pre-Ada: no fp8 conversion instruction. The e4m3fn byte of y in integer arithmetic: the bytes of
// cvt.rn.satfinite and of cuda_fp8.h's emulation for every float (NaN: 0x7F).
__device__ __forceinline__ uint32_t e4m3_encode(float y) {
  const uint32_t b = __float_as_uint(y);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7Fu;
  const uint32_t a = min(b & 0x7FFFFFFFu, 0x43E00000u);  // saturate at 448
  uint32_t r;
  if (a >= 0x3C800000u) {  // normal e4m3: keep 3 mantissa bits, rebias 127 -> 7
    r = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960u;
  } else {  // denormal e4m3: round |y| * 2^9 to an integer
    const uint32_t ea = a >> 23;
    const uint32_t m = (a & 0x7FFFFFu) | (ea ? 0x800000u : 0u);
    const uint32_t s = min(141u - max(ea, 1u), 31u);
    r = (m + (1u << (s - 1)) - 1u + ((m >> s) & 1u)) >> s;
  }
  return r | ((b >> 24) & 0x80u);
}
#endif

// Two values -> two fp8 bytes of the format kFmt, a in the low byte.
template <codes::KvFormat kFmt>
__device__ __forceinline__ uint32_t fp8x2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  if constexpr (fp8_interp(kFmt) == __NV_E4M3) return (e4m3_encode(b) << 8) | e4m3_encode(a);
#endif
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, fp8_interp(kFmt));
}

template <codes::KvFormat kFmt>
__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
  return fp8x2<kFmt>(a, b) | (fp8x2<kFmt>(c, d) << 16);
}

template <codes::KvFormat kFmt>
__device__ __forceinline__ uint8_t fp8_byte(float a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  if constexpr (fp8_interp(kFmt) == __NV_E4M3) return static_cast<uint8_t>(e4m3_encode(a));
#endif
  return __nv_cvt_float_to_fp8(a, __NV_SATFINITE, fp8_interp(kFmt));
}

// The order quantize issues its arithmetic in: the same bytes, which ptxas schedules differently. Each
// writer keeps the order its kernels were tuned and measured with (a new order is a kernel change to
// measure: docs/performance.md "QuantizeOrder"): "value" is one source element, "word" the two 16-bit
// values of a source word.
enum class QuantizeOrder {
  kWordsThenConvert,   // per word: both values, their quotients; the conversions after the last quotient
                       // (set_mla_kv_buffer's fp8 writers, the benchmark's latency floors)
  kValuesThenConvert,  // per value: its bits, its quotient; the conversions after the last quotient
                       // (store_cache's latency and row kernels)
  kEachPair,           // per pair: each value's bits and quotient, then the pair's conversion (store_cache's
                       // bulk kernel: with RnDivider's branches, few values live at once)
  kEachWord,           // per word: both values, both quotients, the word's conversion (the indexer writer)
  kEachWordHighFirst,  // per word: the high value's quotient, the low value's, the word's conversion
                       // (the DeepSeek-V4 writer)
};

// N source values -> N fp8 bytes (N even; 4 bytes per word, the first value lowest, a last half word in
// the low 16 bits): the source words hold two 16-bit values each (the low half first) or one fp32
// value; value x is stored as fp8(div(x)), in the order kOrder.
template <codes::SrcDtype kSrc, codes::KvFormat kFmt, int N, QuantizeOrder kOrder = QuantizeOrder::kWordsThenConvert,
          class Div>
__device__ __forceinline__ void quantize(const uint32_t* src, uint32_t* out, const Div& div) {
  static_assert(N % 2 == 0, "pairs of values");
  using S = SrcTraits<kSrc>;
  using O = QuantizeOrder;
  if constexpr (kOrder == O::kWordsThenConvert || kOrder == O::kValuesThenConvert) {
    float q[N];
    if constexpr (kOrder == O::kWordsThenConvert && S::kBytes == 2) {
#pragma unroll
      for (int k = 0; k < N / 2; ++k) {
        const float2 x = S::pair(src[k]);
        q[2 * k] = div(x.x);
        q[2 * k + 1] = div(x.y);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) q[i] = div(S::at(src, i));
    }
#pragma unroll
    for (int j = 0; j < N / 4; ++j) out[j] = fp8x4<kFmt>(q[4 * j], q[4 * j + 1], q[4 * j + 2], q[4 * j + 3]);
    if constexpr (N % 4 != 0) out[N / 4] = fp8x2<kFmt>(q[N - 2], q[N - 1]);
  } else if constexpr (kOrder == O::kEachPair) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      const uint32_t lo = fp8x2<kFmt>(div(S::at(src, 4 * j)), div(S::at(src, 4 * j + 1)));
      const uint32_t hi = fp8x2<kFmt>(div(S::at(src, 4 * j + 2)), div(S::at(src, 4 * j + 3)));
      out[j] = lo | (hi << 16);
    }
    if constexpr (N % 4 != 0) out[N / 4] = fp8x2<kFmt>(div(S::at(src, N - 2)), div(S::at(src, N - 1)));
  } else {
    static_assert(S::kBytes == 2, "words of two values");
#pragma unroll
    for (int j = 0; j < (N + 2) / 4; ++j) out[j] = 0;
#pragma unroll
    for (int w = 0; w < N / 2; ++w) {
      float lo, hi;
      if constexpr (kOrder == O::kEachWord) {
        const float a = S::at(src, 2 * w), b = S::at(src, 2 * w + 1);
        lo = div(a);
        hi = div(b);
      } else {
        hi = div(S::at(src, 2 * w + 1));
        lo = div(S::at(src, 2 * w));
      }
      out[w / 2] |= fp8x2<kFmt>(lo, hi) << (16 * (w % 2));
    }
  }
}

// The 8 fp8 bytes of a 16-byte vector of 16-bit values (the lowest first).
template <codes::SrcDtype kSrc, codes::KvFormat kFmt, QuantizeOrder kOrder = QuantizeOrder::kWordsThenConvert,
          class Div>
__device__ __forceinline__ uint2 quantize8(const uint4& v, const Div& div) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t q[2];
  quantize<kSrc, kFmt, 8, kOrder>(w, q, div);
  return make_uint2(q[0], q[1]);
}

// Largest magnitude of a vector's values leaving NaN out (fmaxf's rule), one by one.
template <codes::SrcDtype kSrc>
__device__ __forceinline__ uint32_t max_mag_no_nan(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t best = 0;
  for (int k = 0; k < 8; ++k) {
    const uint32_t m = (w[k / 2] >> (16 * (k % 2))) & 0x7fffu;
    if (m <= SrcTraits<kSrc>::kNanAbove && m > best) best = m;
  }
  return best;
}

// Largest magnitude (a 16-bit pattern without its sign) of a 16-byte vector's 8 values, NaN left out
// (fmaxf's rule): packed 16-bit max; a vector whose largest half is a NaN pattern (the carry of
// adding 0x7fff - inf reaches the half's top bit) takes max_mag_no_nan.
template <codes::SrcDtype kSrc>
__device__ __forceinline__ uint32_t vec_amax_no_nan(const uint4& v) {
  constexpr uint32_t kNanCarry = (0x7fffu - SrcTraits<kSrc>::kInf) * 0x10001u;
  const uint32_t a = v.x & 0x7fff7fffu, b = v.y & 0x7fff7fffu, c = v.z & 0x7fff7fffu, d = v.w & 0x7fff7fffu;
  const uint32_t mx = __vmaxu2(__vmaxu2(a, b), __vmaxu2(c, d));
  if ((mx + kNanCarry) & 0x80008000u) return max_mag_no_nan<kSrc>(v);
  return max(mx >> 16, mx & 0xffffu);
}

// A tile's scale max(amax / fp8_max, FLT_MIN) from its amax (a 16-bit magnitude of kSrc, not NaN),
// the quotient correctly rounded without __fdiv_rn's range check and branch (which would keep the
// tiles' reductions from overlapping): q = amax * RN(1 / fp8_max) and one residual correction give it
// for every finite bf16 and fp16 amax and fp8_max 448 (the CUDA tests feed every one of them); +inf
// stays +inf.
template <codes::SrcDtype kSrc>
__device__ __forceinline__ float amax_scale(uint32_t amax, float fp8_max) {
  const float inv = 1.0f / fp8_max;
  const float a = SrcTraits<kSrc>::value(amax);
  const float q = __fmul_rn(a, inv);
  const float exact = __fmaf_rn(__fmaf_rn(-q, fp8_max, a), inv, q);
  return fmaxf(amax == SrcTraits<kSrc>::kInf ? a : exact, FLT_MIN);
}

}  // namespace cuda
}  // namespace jitkv
