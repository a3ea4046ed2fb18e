// Exact fp32 division for the CUDA fp8 writers (store_cache, set_mla_kv_buffer): stored =
// cvt.rn.satfinite(x / scale) needs the correctly rounded quotient, which __fdiv_rn gives at the cost
// of a range check and a branch per element.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jitkv {
namespace cuda {

// Bit-identical to __fdiv_rn(x, s) but without a branch per element. __fdiv_rn's fast path is
// r = rcp.approx(s) refined by one Newton step, q = x * r, q' = q + r * (x - q * s), exact wherever its
// FCHK range check passes, else a slow subroutine. Here r is computed once; each element runs the
// same arithmetic (the residual enters negated so that x = -0 keeps its sign), and a vector with any
// element outside a conservative window (|x| and |x / s| within 2^+-100, or x = +-0) is redone with
// __fdiv_rn. Scales outside [2^-100, 2^101) always take __fdiv_rn.
struct Divider {
  float s, r;
  uint32_t lo, span;  // fast iff biased exponent of x - lo < span (unsigned), or x == +-0

  Divider() = default;
  __device__ __forceinline__ explicit Divider(float scale) : s(scale) {
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(scale));
    r = __fmaf_rn(r0, __fmaf_rn(r0, -scale, 1.0f), r0);
    const int eb = int(__float_as_uint(scale) >> 23);  // scale > 0: no sign bit
    const int lo_e = max(27, eb - 100), hi_e = min(227, eb + 100);
    lo = uint32_t(lo_e);
    span = (eb >= 27 && eb <= 227) ? uint32_t(hi_e - lo_e + 1) : 0u;
  }

  __device__ __forceinline__ bool fast(float x) const {
    const uint32_t a = __float_as_uint(x) & 0x7fffffffu;
    return (a >> 23) - lo < span || a == 0;
  }

  __device__ __forceinline__ float quick(float x) const {
    const float q = __fmul_rn(x, r);
    return __fmaf_rn(-r, __fmaf_rn(q, s, -x), q);
  }
};

}  // namespace cuda
}  // namespace jitkv
