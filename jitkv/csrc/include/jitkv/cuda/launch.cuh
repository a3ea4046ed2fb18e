// Launch helpers shared by every jitkv CUDA module: programmatic dependent launch, the launch call and
// its error check, the per-device info cache and the device guard.
//
// A kernel launched with the attribute may start while the previous kernel on its stream is still
// running; it must not touch memory that kernel may write until griddepcontrol.wait returns (which is
// after the previous grid completed and flushed). Our kernels call pdl_wait() before their first
// global access and pdl_launch_dependents() right after, so the next kernel's launch overlaps ours.
// Both are no-ops below sm_90 or when the kernel was launched without the attribute, so launching with
// PDL is always safe; measured on H200 it saves 0.4-0.6 us per launch under CUDA-graph replay.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/error.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace jitkv {
namespace cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Every load of what the previous kernel may write (indices, sources, scales, caches; anything read
// after pdl_wait()) goes through load(): a coherent ld.global, never ld.global.nc / __ldg. A
// non-coherent load promises that the data stays read-only for the whole kernel, which PDL breaks (this
// kernel starts while the previous one still writes), and ptxas acts on that promise: it scheduled the
// DSv4 writer's ld.global.nc loads above griddepcontrol.wait. jitkv/tests/jit/test_build.py checks the
// SASS of every kernel for a global access before the wait.
// The load is an LDG even where the compiler only sees a generic pointer, and volatile, so that the
// compiler keeps it after the wait too. T: 1, 2, 4, 8 or 16 bytes.
template <typename T>
__device__ __forceinline__ T load(const T* p) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16,
                "a load of 1, 2, 4, 8 or 16 bytes");
  T v;
  if constexpr (sizeof(T) == 16) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    memcpy(&v, &r, 16);
  } else if constexpr (sizeof(T) == 8) {
    unsigned long long r;
    asm volatile("ld.global.u64 %0, [%1];" : "=l"(r) : "l"(p));
    memcpy(&v, &r, 8);
  } else if constexpr (sizeof(T) == 4) {
    unsigned r;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(r) : "l"(p));
    memcpy(&v, &r, 4);
  } else if constexpr (sizeof(T) == 2) {
    unsigned short r;
    asm volatile("ld.global.u16 %0, [%1];" : "=h"(r) : "l"(p));
    memcpy(&v, &r, 2);
  } else {
    unsigned short r;
    asm volatile("ld.global.u8 %0, [%1];" : "=h"(r) : "l"(p));
    const unsigned char b = static_cast<unsigned char>(r);
    memcpy(&v, &b, 1);
  }
  return v;
}

// Reads one word of every 64-byte constant-cache line of a kernel's parameter block and waits for
// them. Called before pdl_wait(), so under PDL it overlaps the previous kernel; otherwise the first use
// of each line after the slot load is a constant-cache miss on the critical path (slot -> source ->
// store). The words feed a branch on `n` (a count of the launch that is never negative; the compiler
// cannot know that), which keeps the loads and waits for them.
// Measured on an H100 under the benchmark's graph replay (python -m jitkv.benchmark, and scratch
// variants of the MLA row copy's kernel), against no warming: the MLA copy, fp8 MLA, DSv4 writer and
// indexer writer 1-7 % faster at n <= 128, store_cache within noise. How matters as much:
//  - a block of only what the kernel reads (MlaArgs, 80 bytes: 0.83 us at n = 1; the same code with 16
//    unread bytes in its block 0.90, with 208 0.99);
//  - the branch compares the loaded words first (`x == c && n < 0`): written `n < 0 && x == 0` the
//    compiler loads them through the uniform datapath and the copy ran 0.03-0.06 us slower at n <= 128;
//  - no shared-memory sink for the words (4 bytes of static shared memory cost 0.01-0.05 us).
// Params must be a __grid_constant__ kernel parameter (taking the address of any other parameter
// makes a local copy).
template <typename Params>
__device__ __forceinline__ void warm_params(const Params& params, int64_t n) {
  static_assert(sizeof(Params) >= 4 && alignof(Params) >= 4, "parameter block of whole words");
  const unsigned* words = reinterpret_cast<const unsigned*>(&params);
  constexpr unsigned kWords = sizeof(Params) / 4;
  unsigned x = words[kWords - 1];
#pragma unroll
  for (unsigned w = 0; w < kWords; w += 16) x ^= words[w];  // 16 words = 64 bytes
  if (x == 0x9e3779b9u && n < 0) __trap();  // never taken
}

// Whether `bytes` (a stride or offset) is a whole number of `unit`-byte units, at most `max_units` of
// them: what a compact parameter block (32- or 16-bit fields in units) can hold.
inline bool fits_units(int64_t bytes, int64_t unit, int64_t max_units) {
  return bytes >= 0 && bytes % unit == 0 && bytes / unit <= max_units;
}

// Launches kernel<<<grid, block, 0, stream>>>(args...), with PDL when `pdl` (callers pass false below
// sm_90, where the attribute does not exist).
template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl,
                   Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = stream;
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
}

// What launches need to know about a device, queried once per device (an attribute query costs about
// a microsecond of the launch path). Racing first calls store the same values.
struct DeviceInfo {
  int sms = 0;    // multiprocessors; 0 if the query failed
  int major = 0;  // compute capability major
  bool pdl() const { return major >= 9; }  // programmatic dependent launch exists from sm_90
};

inline DeviceInfo device_info(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms_of[kMaxDevices];
  static std::atomic<int> major_of[kMaxDevices];
  const bool cache = device >= 0 && device < kMaxDevices;
  DeviceInfo info;
  if (cache) {
    info.sms = sms_of[device].load(std::memory_order_relaxed);
    info.major = major_of[device].load(std::memory_order_relaxed);
  }
  if (info.sms == 0 &&
      cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && cache) {
    major_of[device].store(info.major, std::memory_order_relaxed);
    sms_of[device].store(info.sms, std::memory_order_relaxed);
  }
  return info;
}

// Warps per block for a grid of `warps` independent latency-bound warps: one per block while every
// warp can have an SM to itself, then 2, 4, ... up to `max_warps` as the grid grows past 1, 2, 4 ...
// warps per SM (fewer, fuller blocks cost less to schedule once the SMs are all busy).
inline int spread_warps_per_block(int64_t warps, int sms, int max_warps = 8) {
  int w = 1;
  while (w < max_warps && warps > static_cast<int64_t>(w) * sms) w *= 2;
  return w;
}

// Warps per block of a latency kernel (its warps each load, maybe convert, and store one short
// piece): 4 while the grid has at most 8 warps per SM, 8 beyond. Measured on an NVIDIA H100 under
// CUDA-graph replay (python -m jitkv.benchmark --op set_mla_kv_buffer / --op store_cache): against one
// warp per block while the SMs have room (spread_warps_per_block), store_cache H8 D128 bf16 at n = 16
// / 64 / 256 1.04 / 1.12 / 1.46 us against 1.08 / 1.16 / 1.51, the MLA row copy 0.02-0.06 us faster at
// n <= 256; 8 per block from 8 warps per SM on (MLA n = 2048: 2.37 against 2.48 us with 4).
inline int latency_warps_per_block(int64_t warps, int sms) { return warps <= 8 * static_cast<int64_t>(sms) ? 4 : 8; }

// Raises RuntimeError "<op>: kernel launch failed: <CUDA's reason>" when a launch failed.
inline void check_launch(const char* op, cudaError_t err) {
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << op << ": kernel launch failed: " << cudaGetErrorString(err);
  }
}

// Makes `device` current for a launch and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int cur = prev_;
    cudaGetDevice(&cur);
    if (cur != prev_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

}  // namespace cuda
}  // namespace jitkv
