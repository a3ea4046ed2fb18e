// store_cache CUDA launcher: instantiates store_cache_kernel (store_cache.cuh) for this module's
// template arguments and launches it on the caller's stream under a device guard.
//
// Template arguments (defines; the Python side builds one module per distinct tuple):
//   JITKV_K_HEAD_BYTES, JITKV_V_HEAD_BYTES  cache bytes per K / V head (head_dim * cache element size),
//       multiples of 16, for caches and sources whose base addresses and strides are 16-byte aligned;
//       0 and 0 select the generic build: any head size and alignment, vector width picked per call
//       (16, 8, 4, 2 or 1 bytes).
//   JITKV_SRC_DTYPE  0: plain byte copy (kv_cache_dtype "auto", any dtype); 1 bf16, 2 fp16, 3 fp32
//       (sources quantized to fp8).
//   JITKV_KV_DTYPE   0 auto, 1 fp8_e4m3, 2 fp8_e5m2 (jitkv::KVDtype values).
// Kernels launch with programmatic dependent launch on SM90+ (jitkv/cuda/launch.cuh).
// Launch shape: one warp per (token, chunk[, side]); 1, 2, 4 or 8 warps per block so that small n
// spreads over SMs and large n fills them. Each build holds two kernels (store_cache.cuh): the latency
// kernel while its warps per token side fit in kLatencyWarpsPerSM per SM, the bulk kernel beyond.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include "store_cache/store_cache.cuh"

namespace {

using namespace jitkv::store_cache;

constexpr int kKHeadBytes = JITKV_K_HEAD_BYTES;
constexpr int kVHeadBytes = JITKV_V_HEAD_BYTES;
constexpr SrcType kSrc = static_cast<SrcType>(JITKV_SRC_DTYPE);
constexpr Fp8 kFp8 = static_cast<Fp8>(JITKV_KV_DTYPE);
constexpr bool kGeneric = kKHeadBytes == 0;
static_assert((kKHeadBytes == 0) == (kVHeadBytes == 0), "K and V are both specialised or both generic");
static_assert(kKHeadBytes % 16 == 0 && kVHeadBytes % 16 == 0, "specialised head bytes must be multiples of 16");

constexpr int kMaxDevices = 64;
// Latency kernels while n x chunks (x 2 sides for fp8) stays within this many warps per SM. NVIDIA
// H100, H=8 D=128, CUDA-graph replay (python -m jitkv.benchmark --op store_cache): bf16 latency vs
// bulk kernel n = 1024 4.4 vs 4.9 us, 2048 7.3 vs 7.9, 4096 13.4 vs 13.4 (256 warps per SM: 13.6);
// e4m3 n = 4096 10.4 vs 13.4 us, 16,384 35.9 vs 38.8.
constexpr int64_t kLatencyWarpsPerSM = kFp8 == Fp8::kNone ? 64 : 256;

struct DeviceInfo {
  int sms, major;
};

// Cached per device (attribute queries cost about a microsecond); `ready` is published last.
cudaError_t device_info(int device, DeviceInfo* out) {
  static DeviceInfo cache[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && ready[device].load(std::memory_order_acquire)) {
    *out = cache[device];
    return cudaSuccess;
  }
  DeviceInfo info;
  cudaError_t err = cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  if (cached) {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    if (!ready[device].load(std::memory_order_relaxed)) {
      cache[device] = info;
      ready[device].store(true, std::memory_order_release);
    }
  }
  *out = info;
  return cudaSuccess;
}

// Warps per token: chunks of 32 * unroll destination vectors over the longer of the K and V rows.
int64_t chunks_per_token(const Params& p, bool bulk) {
  const int64_t chunk = 32 * chunk_unroll(kSrc, kFp8, bulk);
  return (std::max(p.k.row_vecs, p.v.row_vecs) + chunk - 1) / chunk;
}

template <int kVec, bool kBulk>
cudaError_t launch(const Params& p, const DeviceInfo& info, cudaStream_t stream) {
  const int64_t chunks = chunks_per_token(p, kBulk);
  const int wpb = jitkv::cuda::spread_warps_per_block(p.n * chunks, info.sms, kMaxWarpsPerBlock);
  return jitkv::cuda::launch(store_cache_kernel<kKHeadBytes, kVHeadBytes, kVec, kSrc, kFp8, kBulk>,
                             dim3(static_cast<unsigned>((p.n + wpb - 1) / wpb), static_cast<unsigned>(chunks),
                                  split_sides(kFp8, kKHeadBytes, kVHeadBytes, kBulk) ? 2u : 1u),
                             dim3(32 * wpb), stream, info.major >= 9, p);
}

template <int kVec>
cudaError_t launch(const Params& p, int device, cudaStream_t stream) {
  DeviceInfo info;
  cudaError_t err = device_info(device, &info);
  if (err != cudaSuccess) return err;
  if (p.n * chunks_per_token(p, false) <= kLatencyWarpsPerSM * info.sms) return launch<kVec, false>(p, info, stream);
  return launch<kVec, true>(p, info, stream);
}

cudaError_t dispatch(const Params& p, int vec, int device, cudaStream_t stream) {
  if constexpr (kGeneric) {
    switch (vec) {
      case 16: return launch<16>(p, device, stream);
      case 8: return launch<8>(p, device, stream);
      case 4: return launch<4>(p, device, stream);
      case 2: return launch<2>(p, device, stream);
      case 1: return launch<1>(p, device, stream);
      default: return cudaErrorInvalidValue;
    }
  } else {
    return vec == 16 ? launch<16>(p, device, stream) : cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" const char* jitkv_store_cache_launch(const Params* p, int32_t vec, int32_t device, void* stream) {
  int prev = -1;
  cudaError_t err = cudaGetDevice(&prev);
  if (err == cudaSuccess && prev != device) err = cudaSetDevice(device);
  if (err == cudaSuccess) err = dispatch(*p, vec, device, static_cast<cudaStream_t>(stream));
  if (prev >= 0 && prev != device) {
    cudaError_t restore = cudaSetDevice(prev);
    if (err == cudaSuccess) err = restore;
  }
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}
