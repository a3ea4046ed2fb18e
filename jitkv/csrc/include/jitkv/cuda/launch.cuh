// Launch helpers shared by every jitkv CUDA module: programmatic dependent launch, parameter warm-up,
// the launch call and its error check, launch shapes, the per-device info cache and the device guard.
//
// A kernel launched with the attribute may start while the previous kernel on its stream is still
// running; it must not touch memory that kernel may write until griddepcontrol.wait returns (which is
// after the previous grid completed and flushed). Our kernels call pdl_wait() before their first
// global access and pdl_launch_dependents() right after, so the next kernel's launch overlaps ours.
// Both are no-ops below sm_90 or when the kernel was launched without the attribute, so launching with
// PDL is always safe, and it saves time per launch under CUDA-graph replay (docs/performance.md "PDL").
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/error.h>

#include <atomic>
#include <cstdint>

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

// Reads one word of every 64-byte constant-cache line of a kernel's parameter block and waits for
// them. Called before pdl_wait(), so under PDL it overlaps the previous kernel; otherwise the first use
// of each line after the slot load is a constant-cache miss on the critical path (slot -> source ->
// store). The words feed a branch on `n` (a count of the launch that is never negative; the compiler
// cannot know that), which keeps the loads and waits for them.
// Measured against no warming, and how it is done matters as much (docs/performance.md "warm_params"):
//  - a block of only what the kernel reads (the compact parameter blocks);
//  - the branch compares the loaded words first (`x == c && n < 0`): written `n < 0 && x == 0` the
//    compiler loads them through the uniform datapath, which ran slower;
//  - no shared-memory sink for the words (static shared memory costs time too).
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
  if (x == 0x9e3779b9u && n < 0) __trap();                  // never taken
}

// Whether `bytes` (a stride or offset) is a whole number of `unit`-byte units, at most `max_units` of
// them: what a compact parameter block (32- or 16-bit fields in units) can hold.
inline bool fits_units(int64_t bytes, int64_t unit, int64_t max_units) {
  return bytes >= 0 && bytes % unit == 0 && bytes / unit <= max_units;
}

// Launches kernel<<<grid, block, 0, stream>>>(args...), with PDL when `pdl` (callers pass false below
// sm_90, where the attribute does not exist).
template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl, Args&&... args) {
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
  int sms = 0;                             // multiprocessors; 0 if the query failed
  int major = 0;                           // compute capability major
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
  if (info.sms == 0 && cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
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
// piece): 4 while the grid has at most 8 warps per SM, 8 beyond; one warp per block while the SMs have
// room (spread_warps_per_block) measured slower (docs/performance.md "latency_warps_per_block").
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
