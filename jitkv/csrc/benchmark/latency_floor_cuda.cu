// Benchmark-only kernel: the fastest KV write the contract allows. One thread waits for the previous
// kernel (PDL), loads loc[0] and 16 source bytes together (one memory round trip), lets the next
// kernel launch, and stores the bytes at that slot if it is in range: the floor under any
// set_mla_kv_buffer / store_cache / DSv4 writer launch at n = 1.
#include <cstdint>

#include "jitkv/cuda/launch.cuh"

namespace {

__global__ void latency_floor_kernel(const int64_t* loc, const uint4* src, char* dst, int64_t row_bytes,
                                     int64_t num_rows) {
  if (threadIdx.x != 0) return;
  jitkv::cuda::pdl_wait();
  const int64_t slot = __ldg(loc);
  const uint4 v = __ldg(src);
  jitkv::cuda::pdl_launch_dependents();
  if (slot >= 0 && slot < num_rows) *reinterpret_cast<uint4*>(dst + slot * row_bytes) = v;
}

}  // namespace

// Returns a cudaError_t. dst rows of row_bytes (16-byte aligned), src 16-byte aligned, loc int64.
extern "C" int jitkv_latency_floor_launch(int device, void* stream, const void* loc, const void* src, void* dst,
                                          int64_t row_bytes, int64_t num_rows) {
  jitkv::cuda::DeviceGuard guard(device);
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  const cudaError_t err = jitkv::cuda::launch(latency_floor_kernel, dim3(1), dim3(32), static_cast<cudaStream_t>(stream),
                                              major >= 9, static_cast<const int64_t*>(loc), static_cast<const uint4*>(src),
                                              static_cast<char*>(dst), row_bytes, num_rows);
  return static_cast<int>(err);
}
