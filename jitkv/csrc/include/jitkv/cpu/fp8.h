// fp32 -> fp8 (e4m3fn, e5m2) quantization for the CPU kernels, bit-exact with torch (fp8_format.h: the
// formats, the scalar conversion and the vector paths' constants; fp8_avx512.h / fp8_avx2.h: the vector
// loops): abs_max and Fp8Quantizer on the path the build targets (jitkv/cpu/isa.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

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

// fp8 conversion by one format and scale, set up once for many segments: the vector paths' setup (the
// reciprocal, the rounding's constants and their broadcasts) costs about as much as converting 32
// values, so callers writing many short segments by one scale build it once.
class Fp8Quantizer {
 public:
  // values: about how many of kind `kind` it converts. From kOnceValues on (a call's rows, not one
  // tile's), the setup checks whether one multiply suffices for bf16 or fp16 sources (fp8_format.h,
  // Fp8Div::once_bits): where it does, the saving passes the check's cost from about that many values
  // (bf16; fp16's check costs about 8x as much, but its verdict is remembered per scale, so a model's
  // scales pay it once per thread).
  static constexpr int64_t kOnceValues = 8192;
  explicit Fp8Quantizer(const Fp8Format& fmt, float scale) : v_(fmt, scale, 0) {}
  Fp8Quantizer(const Fp8Format& fmt, float scale, SrcKind kind, int64_t values)
      : v_(fmt, scale, values >= kOnceValues ? significand_bits(kind) : 0) {}

  // dst[i] = fp8(clamp(src[i] / scale)) for i < n. nt streams whole 64-byte lines (dst 64-byte
  // aligned); the rest of a partial last line is written with regular stores inside it.
  void operator()(uint8_t* dst, SrcKind k, const void* src, int64_t n, bool nt) const {
    with_kind(k, [&](auto kind) {
      constexpr SrcKind K = decltype(kind)::value;
      with_path<K>(v_, [&](auto path) { quantize_seg_k<K, decltype(path)::value>(dst, src, n, v_, nt); });
    });
  }

  // count segments of n values: segment i from src + i * src_step to dst + i * dst_step by quantizer
  // q[i * q_step] (q_step 0: q[0] for all), as operator() each. A row's per-head segments in one call:
  // the source kind is dispatched once, and segments of whole 64-value lines (head dims 64, 128, 256)
  // take the line loop alone, inlined, with no call or tail per head (docs/performance.md "Per-head
  // segments in one loop").
  static void segments(const Fp8Quantizer* q, int64_t q_step, uint8_t* dst, int64_t dst_step, SrcKind k,
                       const char* src, int64_t src_step, int64_t count, int64_t n, bool nt) {
    with_kind(k, [&](auto kind) {
      constexpr SrcKind K = decltype(kind)::value;
      for (int64_t i = 0; i < count; ++i) {
        const Fp8Vec& v = q[i * q_step].v_;
        uint8_t* d = dst + i * dst_step;
        const char* s = src + i * src_step;
        if (n % 64 != 0) {
          q[i * q_step](d, k, s, n, nt);
        } else {
          with_path<K>(v, [&](auto path) { quantize_lines_k<K, decltype(path)::value>(d, s, n, v, nt); });
        }
      }
    });
  }

 private:
  // f(std::integral_constant<Fp8Path, P>) for v's path with sources of kind K.
  template <SrcKind K, class F>
  static void with_path(const Fp8Vec& v, F&& f) {
    if (v.divide) {
      f(std::integral_constant<Fp8Path, Fp8Path::kDivide>{});
    } else if (v.pow2) {
      f(std::integral_constant<Fp8Path, Fp8Path::kPow2>{});
    } else if constexpr (significand_bits(K) != 0) {
      if (v.once_bits == significand_bits(K)) {
        f(std::integral_constant<Fp8Path, Fp8Path::kOnce>{});
      } else {
        f(std::integral_constant<Fp8Path, Fp8Path::kMul>{});
      }
    } else {
      f(std::integral_constant<Fp8Path, Fp8Path::kMul>{});
    }
  }

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

// fp8 conversion by one format and scale (the vector builds' setup is worth sharing; here it is the scale).
class Fp8Quantizer {
 public:
  explicit Fp8Quantizer(const Fp8Format& fmt, float scale) : fmt_(&fmt), scale_(scale) {}
  Fp8Quantizer(const Fp8Format& fmt, float scale, SrcKind, int64_t) : fmt_(&fmt), scale_(scale) {}

  // dst[i] = fp8(clamp(src[i] / scale)) for i < n.
  void operator()(uint8_t* dst, SrcKind k, const void* src, int64_t n, bool) const {
    for (int64_t i = 0; i < n; ++i) dst[i] = quantize_one(load_f32(k, src, i), scale_, *fmt_);
  }

  // The vector builds' segments: segment i by q[i * q_step], as operator() each.
  static void segments(const Fp8Quantizer* q, int64_t q_step, uint8_t* dst, int64_t dst_step, SrcKind k,
                       const char* src, int64_t src_step, int64_t count, int64_t n, bool nt) {
    for (int64_t i = 0; i < count; ++i) q[i * q_step](dst + i * dst_step, k, src + i * src_step, n, nt);
  }

 private:
  const Fp8Format* fmt_;
  float scale_;
};
#endif

}  // namespace cpu
}  // namespace jitkv
