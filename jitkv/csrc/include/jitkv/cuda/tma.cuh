// The bulk (TMA) store of shared memory to global memory, sm_90 and newer (no-ops below): a thread
// writes a row into shared memory, fences the generic proxy against the async one, and one lane
// issues cp.async.bulk for it; the shared memory may be rewritten once the bulk group has read it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jitkv {
namespace cuda {

// One cp.async.bulk of `bytes` (a multiple of 16) from shared memory to dst (16-byte aligned).
__device__ __forceinline__ void bulk_store(char* dst, const char* smem_src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(smem_src));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// Blocks until this thread's bulk groups have finished READING shared memory. That is all slot reuse
// and CTA exit need: the global writes complete by kernel end (before any PDL dependent's wait).
__device__ __forceinline__ void bulk_wait_smem_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}

// Each writer of shared memory: its st.shared must be visible to the bulk copy engine.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

}  // namespace cuda
}  // namespace jitkv
