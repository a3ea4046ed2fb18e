// The source element types of the quantizing kernels (codes::SrcDtype bf16, fp16, fp32): the exact
// float of an element's bits, one at a time or, for the 16-bit types, two per word.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "jitkv/codes.h"

namespace jitkv {
namespace cuda {

template <codes::SrcDtype kSrc>
struct SrcTraits {
  static_assert(kSrc == codes::SrcDtype::kBF16 || kSrc == codes::SrcDtype::kF16 || kSrc == codes::SrcDtype::kF32,
                "a bf16, fp16 or fp32 source");
  static constexpr int kBytes = kSrc == codes::SrcDtype::kF32 ? 4 : 2;
  // 16-bit types: the magnitude bits of inf; a magnitude above it is a NaN.
  static constexpr uint32_t kInf = kSrc == codes::SrcDtype::kBF16 ? 0x7f80u : 0x7c00u;
  static constexpr uint32_t kNanAbove = kInf;

  // One element from its bits (16-bit types: in the low half).
  __device__ __forceinline__ static float value(uint32_t bits) {
    if constexpr (kSrc == codes::SrcDtype::kBF16) {
      return __uint_as_float(bits << 16);
    } else if constexpr (kSrc == codes::SrcDtype::kF16) {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    } else {
      return __uint_as_float(bits);
    }
  }

  // 16-bit types: a word's two elements, the low half first.
  __device__ __forceinline__ static float2 pair(uint32_t w) {
    static_assert(kBytes == 2, "two elements per word");
    if constexpr (kSrc == codes::SrcDtype::kBF16) {
      return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    } else {
      __half2 h;
      memcpy(&h, &w, sizeof(h));
      return __half22float2(h);
    }
  }

  // Element i of a run of words (16-bit types: two per word, the low half first).
  __device__ __forceinline__ static float at(const uint32_t* w, int i) {
    if constexpr (kBytes == 4) {
      return value(w[i]);
    } else {
      return value((w[i / 2] >> (16 * (i % 2))) & 0xffffu);
    }
  }
};

}  // namespace cuda
}  // namespace jitkv
