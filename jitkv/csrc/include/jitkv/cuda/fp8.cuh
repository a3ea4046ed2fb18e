// fp8 arithmetic of the CUDA kernels.
//  - Divider: exact fp32 division for the fp8 writers (store_cache, set_mla_kv_buffer): stored =
//    cvt.rn.satfinite(x / scale) needs the correctly rounded quotient, which __fdiv_rn gives at the
//    cost of a range check and a branch per element; quick_first runs the writers' conversions.
//  - dequant8: eight fp8 bytes times a scale -> eight bf16, for the readers (DeepSeek-V4 gather,
//    gather_mla_cache).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

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

// An empty asm that reads and writes every 32-bit word of v (a last partial word zero-padded): v's
// value is computed before it.
template <class T>
__device__ __forceinline__ void pin_words(T& v) {
  uint32_t w[(sizeof(T) + 3) / 4] = {};
  memcpy(w, &v, sizeof(T));
#pragma unroll
  for (uint32_t& x : w) asm volatile("" : "+r"(x));
  memcpy(&v, w, sizeof(T));
}

// f(std::true_type) converts through Divider::quick, f(std::false_type) through Divider::exact, each
// returning the packed fp8 words. The quick conversion runs for every scale and is pinned before the
// window test (quick_exact: every divider of f in its window), so a scale inside the window (every
// scale a model uses) never waits for that test and its branch; a scale outside it converts a second
// time, exactly. NVIDIA H100, graph replay, same run, against testing the window first: 512+64 bf16
// -> e4m3 MLA rows (lanes kernel) n = 1 / 2 / 4 0.884 / 0.891 / 0.897 us against 0.901 / 0.908 / 0.919,
// level at 16-64 rows; H=8 x D=128 store_cache rows level within +-0.02 us at n = 1-64.
template <class F>
__device__ __forceinline__ auto quick_first(bool quick_exact, F&& f) {
  auto q = f(std::true_type{});
  pin_words(q);
  if (!quick_exact) q = f(std::false_type{});
  return q;
}

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
