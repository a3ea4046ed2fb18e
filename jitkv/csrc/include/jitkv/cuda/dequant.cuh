// fp8 -> bf16 of the CUDA readers (the DeepSeek-V4 gather, gather_mla_cache): dequant8, eight fp8 bytes
// times a scale -> eight bf16, exact up to the final rounding to bf16.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jitkv {
namespace cuda {

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
