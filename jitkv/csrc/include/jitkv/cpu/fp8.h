// fp32 -> fp8 (e4m3fn, e5m2) quantization for the CPU kernels, bit-exact with torch (fp8_format.h: the
// formats, the scalar conversion and the vector paths' constants; fp8_avx512.h / fp8_avx2.h: the vector
// loops): abs_max and Fp8Quantizer / quantize_seg on the path the build targets (jitkv/cpu/isa.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "jitkv/cpu/fp8_avx2.h"
#include "jitkv/cpu/fp8_avx512.h"
#include "jitkv/cpu/fp8_format.h"

namespace jitkv {
namespace cpu {

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
