// fp8 arithmetic of the CUDA kernels.
//  - Divider: exact fp32 division for the fp8 writers (store_cache, set_mla_kv_buffer): stored =
//    cvt.rn.satfinite(x / scale) needs the correctly rounded quotient, which __fdiv_rn gives at the
//    cost of a range check and a branch per element; Divider::quick gives it with neither.
//  - dequant8: eight fp8 bytes times a scale -> eight bf16, for the readers (DeepSeek-V4 gather,
//    gather_mla_cache).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace jitkv {
namespace cuda {

// Division by one scale, for an fp8 conversion, with no branch: quick(x) is __fdiv_rn's own fast path
// (r = rcp.approx(s) refined by one Newton step, q = x * r, q' = q + r * (x - q * s), the residual
// entering negated so that x = -0 keeps its sign) without its per-element range check. __fdiv_rn's
// result is the correctly rounded quotient wherever no intermediate over- or underflows; for a scale
// with 2^-80 <= s < 2^100 the other cases give the same fp8 byte:
//  - |x * r| >= 2^128: q = +-inf and q' NaN; quick returns q, saturated to +-max like the true
//    quotient (at least 2^127 in magnitude). x = +-inf likewise; x NaN stays NaN.
//  - |x| < 2^-103 (the residual may round): |x / s| < 2^-23 and q' within a few ulps of it, both
//    below half the smallest subnormal of e4m3 (2^-9) and e5m2 (2^-16): +-0 with x's sign.
// Any other finite scale > 0 is brought into that window by a power of two f (2^100 below it, 2^-100
// above it, 1 inside), which multiplies x too: x * f / (scale * f) is x / scale, and where x * f is
// not exact the fp8 byte is still the true quotient's: x * 2^100 overflows only where |x / scale| >=
// 2^128 / 2^20 (saturated; quick(+-inf) is +-inf), and x * 2^-100 rounds only below 2^-126, where
// |x / scale| < 2^-126 (scale * f >= 1) gives +-0. scale = +inf (an fp8_ds_mla tile holding an
// infinity) takes f = 0 and a finite s: +-0 for finite x, NaN for +-inf, as __fdiv_rn. The window
// test and both scaled products run side by side, so the reciprocal waits for two selects more than
// the bare one, and there is no branch. NVIDIA H100, graph replay, against __fdiv_rn's fast path
// behind a window test and a branch to __fdiv_rn, same runs (two hosts): the floors of
// python -m jitkv.benchmark ("latency floor" rows: one thread, 8 bf16 values -> e4m3 at n = 1) 0.842 /
// 0.870 us against 0.849 / 0.878, the fp8_ds_mla floor (one warp, two tiles) 0.903 / 0.914 against
// 0.948 / 0.960; fp8_ds_mla writes of 512+64 bf16 rows 0.03-0.05 us faster at n = 1-64, store_cache
// H8 D128 e4m3 0-0.03 us faster, e4m3 MLA rows level. A scale that is not finite and > 0 otherwise (a
// device scale is not checked unless JITKV_DEBUG=1) gives unspecified codes. The CUDA tests feed every
// bf16 and fp16 value through each writer at scales on both sides of the window.
struct Divider {
  float f;      // multiplies x: the power of two that brings the scale into the window (1 inside it)
  float s, r;   // the scale times f (finite) and its refined reciprocal
  float scale;  // as given (__fdiv_rn by it: the bulk kernels)

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
  __device__ __forceinline__ float quick(float x) const {
    x = __fmul_rn(x, f);
    const float q = __fmul_rn(x, r);
    const float refined = __fmaf_rn(-r, __fmaf_rn(q, s, -x), q);
    return fabsf(q) == __int_as_float(0x7f800000) ? q : refined;
  }
};

__device__ __forceinline__ float f16_bits_to_f32(uint32_t h) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 890
// Pre-Ada: no fp8 conversion instruction. One e4m3fn byte -> float, exact (0x7F / 0xFF: NaN).
__device__ __forceinline__ float e4m3_to_f32(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u, sign = (b & 0x80u) << 24;
  if ((b & 0x7Fu) == 0x7Fu) return __uint_as_float(0x7FC00000u | sign);
  if (e == 0) return __uint_as_float(__float_as_uint(static_cast<float>(m) * 0.001953125f) | sign);  // m * 2^-9
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}
#endif

// Two fp8 bytes (bits 0-7 and 8-15 of q; e5m2 when kE5M2, else e4m3fn) -> two floats, exact: an e5m2
// byte is the high byte of the fp16 of the same value, and f16 holds every e4m3 value.
template <bool kE5M2>
__device__ __forceinline__ void fp8x2_to_f32(uint32_t q, float& lo, float& hi) {
  if constexpr (kE5M2) {
    lo = f16_bits_to_f32((q & 0xFFu) << 8);
    hi = f16_bits_to_f32(q & 0xFF00u);
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(q)));
    lo = f16_bits_to_f32(h2 & 0xFFFFu);
    hi = f16_bits_to_f32(h2 >> 16);
#else
    lo = e4m3_to_f32(q & 0xFFu);
    hi = e4m3_to_f32((q >> 8) & 0xFFu);
#endif
  }
}

__device__ __forceinline__ uint32_t bf16x2(float hi, float lo) {  // round to nearest even; NaN -> 0x7FFF
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Eight fp8 bytes (w0 then w1, lowest byte first) times scale -> eight bf16 (16 bytes): bf16(float(x) * scale).
template <bool kE5M2>
__device__ __forceinline__ uint4 dequant8(uint32_t w0, uint32_t w1, float scale) {
  uint32_t o[4];
  const uint32_t w[2] = {w0, w1};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float lo, hi;
    fp8x2_to_f32<kE5M2>(w[k / 2] >> (16 * (k % 2)), lo, hi);
    o[k] = bf16x2(hi * scale, lo * scale);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

}  // namespace cuda
}  // namespace jitkv
