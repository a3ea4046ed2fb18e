// Exact fp32 division for the CUDA fp8 writers (store_cache, set_mla_kv_buffer): stored =
// cvt.rn.satfinite(x / scale) needs the correctly rounded quotient, which __fdiv_rn gives at the cost
// of a range check and a branch per element.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jitkv {
namespace cuda {

// Division by one scale, for an fp8 conversion: quick(x) is __fdiv_rn's own fast path (r = rcp.approx(s)
// refined by one Newton step, q = x * r, q' = q + r * (x - q * s), the residual entering negated so
// that x = -0 keeps its sign) without its per-element range check and branch. __fdiv_rn's result is
// the correctly rounded quotient wherever no intermediate over- or underflows; for a scale with
// 2^-80 <= s < 2^100 (quick_exact) the other cases give the same fp8 byte:
//  - |x * r| >= 2^128: q = +-inf and q' NaN; quick returns q, saturated to +-max like the true
//    quotient (at least 2^127 in magnitude). x = +-inf likewise; x NaN stays NaN.
//  - |x| < 2^-103 (the residual may round): |x / s| < 2^-23 and q' within a few ulps of it, both
//    below half the smallest subnormal of e4m3 (2^-9) and e5m2 (2^-16): +-0 with x's sign.
// Other scales take exact() (__fdiv_rn) for every element. The CUDA tests feed every bf16 and fp16
// value through each writer at scales on both sides of the window.
struct Divider {
  static constexpr uint32_t kLoExp = 127 - 80, kSpan = 100 + 80;  // biased exponents of 2^-80 ... 2^99

  float s, r;
  bool quick_exact;

  Divider() = default;
  __device__ __forceinline__ explicit Divider(float scale) : s(scale) {
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(scale));
    r = __fmaf_rn(r0, __fmaf_rn(r0, -scale, 1.0f), r0);
    quick_exact = (__float_as_uint(scale) >> 23) - kLoExp < kSpan;  // scale > 0: no sign bit
  }

  __device__ __forceinline__ float quick(float x) const {
    const float q = __fmul_rn(x, r);
    const float refined = __fmaf_rn(-r, __fmaf_rn(q, s, -x), q);
    return fabsf(q) == __int_as_float(0x7f800000) ? q : refined;
  }

  __device__ __forceinline__ float exact(float x) const { return __fdiv_rn(x, s); }
};

}  // namespace cuda
}  // namespace jitkv
