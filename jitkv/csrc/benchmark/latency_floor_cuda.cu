// Benchmark-only kernel: the shortest launch that obeys the KV-write contract (DESIGN §3.2: a row's
// slot is read before anything of the row). One thread waits for the previous kernel (PDL), loads
// loc[0], then 16 source bytes, and stores them at that slot: two dependent memory round trips and a
// store, the floor under any set_mla_kv_buffer / store_cache launch at n = 1.
#include <cstdint>

#include "jitkv/cuda/launch.cuh"

namespace {

__global__ void latency_floor_kernel(const int64_t* loc, const uint4* src, char* dst, int64_t row_bytes,
                                     int64_t num_rows) {
  jitkv::cuda::pdl_wait();
  jitkv::cuda::pdl_launch_dependents();
  if (threadIdx.x != 0) return;
  const int64_t slot = loc[0];
  if (slot >= 0 && slot < num_rows) *reinterpret_cast<uint4*>(dst + slot * row_bytes) = src[0];
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
