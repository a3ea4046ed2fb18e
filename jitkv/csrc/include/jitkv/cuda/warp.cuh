// Warp-level helpers of the CUDA kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jitkv {
namespace cuda {

constexpr unsigned kFullWarp = 0xffffffffu;  // every lane of the warp

// Lane src's 64-bit v, to every lane (two 32-bit shuffles).
__device__ __forceinline__ int64_t shfl64(int64_t v, int src) {
  const int lo = __shfl_sync(kFullWarp, static_cast<int>(v), src);
  const int hi = __shfl_sync(kFullWarp, static_cast<int>(v >> 32), src);
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(hi)) << 32) | static_cast<uint32_t>(lo));
}

}  // namespace cuda
}  // namespace jitkv
