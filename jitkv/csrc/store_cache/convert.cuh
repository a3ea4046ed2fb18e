// store_cache's conversion of one destination vector: the copy's bytes, or kVec fp8 bytes from kVec
// bf16 / fp16 / fp32 source values (jitkv/cuda/fp8.cuh), and the launch constants that depend on it.
//
// FP8: stored = fp8(x / scale): a true fp32 division (bit-identical to __fdiv_rn), then the hardware
// round-to-nearest-even conversion, which saturates finite overflow and +-inf to +-max (the same bytes
// as clamp(-max, max) first) and maps NaN to 0x7F. The latency kernels divide without a branch
// (cuda::Divider); the bulk kernel calls __fdiv_rn per element (cuda::RnDivider: fewer registers),
// which at large n is the faster (docs/performance.md "store_cache division").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jitkv/codes.h"
#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/src.cuh"
#include "jitkv/cuda/vec.cuh"

namespace jitkv::store_cache {

using codes::KvFormat;
using codes::SrcDtype;
using cuda::Pack;

// Source bytes per destination byte, and destination vectors one lane moves per side and chunk: bulk
// chunks carry 2 KB of source per warp and side (8 independent 16-byte loads per lane for K+V);
// latency kernels move one vector per lane and side.
constexpr int src_ratio(SrcDtype s, KvFormat f) { return f == KvFormat::kCopy ? 1 : s == SrcDtype::kF32 ? 4 : 2; }
constexpr int chunk_unroll(SrcDtype s, KvFormat f, bool bulk) { return bulk ? 4 / src_ratio(s, f) : 1; }
constexpr int kMaxWarpsPerBlock = 8;
// Latency kernels of fp8 builds with K and V heads of one size give K and V separate warps
// (grid.z = 2; see store_cache_kernel).
constexpr bool split_sides(KvFormat f, int k_head_bytes, int v_head_bytes, bool bulk) {
  return f != KvFormat::kCopy && k_head_bytes == v_head_bytes && !bulk;
}

// kBulk: each element through __fdiv_rn (short live ranges, few registers); otherwise every quotient
// of the vector through cuda::Divider at once (more registers, no branch per element, so a lone warp
// finishes fast).
template <SrcDtype kSrc, KvFormat kFmt, bool kBulk>
struct Convert {
  static constexpr bool kQuant = kFmt != KvFormat::kCopy;
  static constexpr int kRatio = src_ratio(kSrc, kFmt);
  static constexpr int kUnroll = chunk_unroll(kSrc, kFmt, kBulk);
  static_assert(kQuant == (kSrc != SrcDtype::kNone), "fp8 builds need a bf16/fp16/fp32 source type");
  static constexpr cuda::QuantizeOrder kOrder =
      kBulk ? cuda::QuantizeOrder::kEachPair : cuda::QuantizeOrder::kValuesThenConvert;

  // N fp8 bytes of the N source values in `in`, x / scale by div(x).
  template <int N, class Div>
  __device__ __forceinline__ static Pack<N> quantize(const Pack<N * kRatio>& in, const Div& div) {
    Pack<N> out;
    if constexpr (N == 1 && kRatio == 2) {  // one 16-bit value
      out.b = cuda::fp8_byte<kFmt>(div(cuda::SrcTraits<kSrc>::value(in.h)));
    } else if constexpr (N == 1) {  // one fp32 value
      out.b = cuda::fp8_byte<kFmt>(div(cuda::SrcTraits<kSrc>::value(in.w[0])));
    } else if constexpr (N == 2) {
      uint32_t w;
      cuda::quantize<kSrc, kFmt, 2, kOrder>(in.w, &w, div);
      out.h = static_cast<uint16_t>(w);
    } else {
      cuda::quantize<kSrc, kFmt, N, kOrder>(in.w, out.w, div);
    }
    return out;
  }

  template <int N>
  __device__ __forceinline__ static Pack<N> run(const Pack<N * kRatio>& in, const cuda::Divider& div) {
    if constexpr (!kQuant) {
      return in;
    } else if constexpr (kBulk) {
      return quantize<N>(in, cuda::RnDivider{div.scale});
    } else {
      return quantize<N>(in, div);
    }
  }
};

}  // namespace jitkv::store_cache
