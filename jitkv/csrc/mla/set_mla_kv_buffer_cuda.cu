// Launcher for the set_mla_kv_buffer kernels (set_mla_kv_buffer.cuh), one module per (nope, rope) byte
// sizes given as -DJITKV_NOPE_BYTES / -DJITKV_ROPE_BYTES. Picks the path, the widest vector the
// alignments allow, warps per block and rows per warp step from n and the SM count, and launches
// (with programmatic dependent launch unless told not to) with the tensors' device current.
//
// Measured on an NVIDIA H200 (132 SMs; copy 4.25 TB/s read+write), CUDA-graph replay, 8 layers of
// 302 MB bf16 512+64 caches, random unique slots (scratch/mla/gpu_run.py):
//  - the vector path is as fast as the TMA bulk store at every n from 1 to 262,144 (within 0.5 %)
//    and faster at small n (no shared-memory round trip), so auto takes it; TMA stays available;
//  - 2 warps per block is best or within noise at every n; 2 rows per warp step gains 2.5 % from
//    n ~ 4096 up (more bytes in flight per warp), so rows = 2 above 16 rows per SM;
//  - PDL saves 0.4-0.6 us per launch at every n;
//  - capping the grid (persistent warps), 3-4 rows per step and cp.async double buffering were no
//    faster: at large n random 1152-byte row writes run at 89 % of copy bandwidth whatever the
//    kernel, against 98 % for the same kernel with sequential slots (DRAM locality, not the kernel).
#include "mla/set_mla_kv_buffer.cuh"
#include "mla/set_mla_kv_buffer_launch.h"

#include <algorithm>

#if !defined(JITKV_NOPE_BYTES) || !defined(JITKV_ROPE_BYTES)
#error "set_mla_kv_buffer_cuda.cu needs -DJITKV_NOPE_BYTES=<bytes> -DJITKV_ROPE_BYTES=<bytes>"
#endif

namespace {

using namespace jitkv::mla;

constexpr int kNope = JITKV_NOPE_BYTES;
constexpr int kRope = JITKV_ROPE_BYTES;
static_assert(kNope >= 0 && kRope >= 0 && kNope + kRope > 0, "empty row");

// TMA kernels are only built when every architecture this module targets has cp.async.bulk.
constexpr int min_target_arch() {
  constexpr int archs[] = {__CUDA_ARCH_LIST__};
  int m = archs[0];
  for (int a : archs) m = a < m ? a : m;
  return m;
}
constexpr bool kTmaBuilt = min_target_arch() >= 900 && (kNope + kRope) % 16 == 0;

struct DeviceInfo {
  int sms = 0;
  int major = 0;
};

// Queried once per device: launches must stay cheap. Racing first calls store the same values.
DeviceInfo device_info(int dev) {
  static DeviceInfo cache[64];
  DeviceInfo info = (dev >= 0 && dev < 64) ? cache[dev] : DeviceInfo{};
  if (info.sms == 0) {
    cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, dev);
    if (info.sms > 0 && dev >= 0 && dev < 64) cache[dev] = info;
  }
  return info;
}

// Largest power of two <= 16 dividing every value: the lowest set bit of their OR.
int common_pow2(uint64_t bits) {
  bits |= 16;
  return static_cast<int>(bits & (~bits + 1));
}

uint64_t u(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); }
uint64_t u(int64_t x) { return static_cast<uint64_t>(x); }

// Widest vector for the loads of k_nope / k_rope (and, on the vector path, for the destination).
int source_vec_bytes(const JitkvMlaLaunchParams& p) {
  return common_pow2(kNope | kRope | u(p.nope) | u(p.nope_row_stride) | u(p.rope) | u(p.rope_row_stride));
}
int vector_path_vec_bytes(const JitkvMlaLaunchParams& p) {
  return common_pow2(source_vec_bytes(p) | u(p.dst) | u(p.dst_row_stride));
}

// Launch shape: warps per block, rows per warp step, speculative loads.
struct Shape {
  int warps;
  int rows;
  bool spec;
};

// Tuned shapes exist for 16-byte vectors on rows that fit in registers; anything else (misaligned
// tensors, very long rows) runs one fixed shape.
// (RowShape is named through V so that it is only instantiated for widths that divide the parts.)
template <int V>
constexpr bool tunable() {
  if constexpr (V == 16 && kNope % 16 == 0 && kRope % 16 == 0) {
    return RowShape<kNope, kRope, V>::kInRegisters;
  } else {
    return false;
  }
}
// Two rows per step only while both fit in 24 registers per lane (no spills; 1152-byte rows do).
template <int V = 16>
constexpr bool two_rows() {
  if constexpr (tunable<V>()) {
    return 2 * RowShape<kNope, kRope, V>::kIters <= 6;
  } else {
    return false;
  }
}
constexpr int kTunedWarps = 2;  // best or within noise at every n (see the top of this file)
constexpr Shape kFixedShape{2, 1, false};

Shape pick_shape(const JitkvMlaLaunchParams& p, int vec, int sms) {
  if (vec != 16 || !tunable<16>()) return kFixedShape;
  Shape s{kTunedWarps, p.n > 16 * static_cast<int64_t>(sms) ? 2 : 1, p.speculative != 0};
  if (s.spec || !two_rows()) s.rows = 1;  // speculative loads are a small-n tool
  return s;
}

struct Launch {
  MlaKernelParams k;
  Shape shape;
  unsigned blocks;
  bool pdl;
  cudaStream_t stream;
};

template <bool kTma, int V, int W, int R, bool kSpec, typename TLoc>
cudaError_t launch_kernel(const Launch& l) {
  return jitkv::cuda::launch(set_mla_kv_buffer_kernel<kNope, kRope, V, W, R, kTma, kSpec, TLoc>, dim3(l.blocks),
                              dim3(W * 32), l.stream, l.pdl, l.k);
}

template <bool kTma, int V, typename TLoc, int W>
cudaError_t dispatch_rows(const Launch& l) {
  if (l.shape.spec) return launch_kernel<kTma, V, W, 1, true, TLoc>(l);
  if constexpr (two_rows()) {
    if (l.shape.rows == 2) return launch_kernel<kTma, V, W, 2, false, TLoc>(l);
  }
  return l.shape.rows == 1 ? launch_kernel<kTma, V, W, 1, false, TLoc>(l) : cudaErrorInvalidValue;
}

template <bool kTma, int V, typename TLoc>
cudaError_t dispatch_shape(const Launch& l) {
  if constexpr (tunable<V>()) {
    return dispatch_rows<kTma, V, TLoc, kTunedWarps>(l);
  } else {
    return launch_kernel<kTma, V, kFixedShape.warps, kFixedShape.rows, false, TLoc>(l);
  }
}

// V must divide both part sizes; widths that don't are never instantiated.
template <bool kTma, int V, typename TLoc>
cudaError_t dispatch_vec(const Launch& l, int vec) {
  if constexpr (kNope % V != 0 || kRope % V != 0) {
    return dispatch_vec<kTma, V / 2, TLoc>(l, vec);
  } else {
    if constexpr (V > 1) {
      if (vec < V) return dispatch_vec<kTma, V / 2, TLoc>(l, vec);
    }
    return dispatch_shape<kTma, V, TLoc>(l);
  }
}

template <bool kTma>
cudaError_t dispatch(const JitkvMlaLaunchParams& p, int vec, int sms, cudaStream_t stream) {
  Launch l;
  l.k = MlaKernelParams{static_cast<char*>(p.dst), static_cast<const char*>(p.nope), static_cast<const char*>(p.rope),
                        p.loc, p.n, p.num_slots, p.dst_row_stride, p.nope_row_stride, p.rope_row_stride, p.skip_slot};
  l.shape = pick_shape(p, vec, sms);
  const int64_t rows_per_block = static_cast<int64_t>(l.shape.warps) * l.shape.rows;
  // Rows past a full grid are taken by the grid-stride loop.
  l.blocks = static_cast<unsigned>(std::min<int64_t>((p.n + rows_per_block - 1) / rows_per_block, 0x7fffffff));
  l.pdl = p.pdl != 0 && device_info(p.device).major >= 9;
  l.stream = stream;
  return p.loc_i64 ? dispatch_vec<kTma, 16, int64_t>(l, vec) : dispatch_vec<kTma, 16, int32_t>(l, vec);
}

// Discarded (not instantiated) when the module carries no TMA kernels.
template <bool kBuilt>
cudaError_t dispatch_tma(const JitkvMlaLaunchParams& p, int sms, cudaStream_t s) {
  if constexpr (kBuilt) {
    return dispatch<true>(p, source_vec_bytes(p), sms, s);
  } else {
    return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" const char* jitkv_set_mla_kv_buffer_tma_blocker(const JitkvMlaLaunchParams* p) {
  if ((kNope + kRope) % 16 != 0) return "row bytes (nope + rope) are not a multiple of 16";
  if (!kTmaBuilt) return "module not compiled for sm_90 or newer";
  if (device_info(p->device).major < 9) return "device is below sm_90 (no TMA bulk copy)";
  if (u(p->dst) % 16 != 0) return "kv_buffer data pointer is not 16-byte aligned";
  if (u(p->dst_row_stride) % 16 != 0) return "kv_buffer row stride is not a multiple of 16 bytes";
  return nullptr;
}

extern "C" int jitkv_set_mla_kv_buffer_launch(const JitkvMlaLaunchParams* p, void* stream) {
  if (p->n <= 0) return cudaSuccess;
  // Auto takes the vector path: never slower than TMA on H200 (see the top of this file).
  const int path = p->path == JITKV_MLA_PATH_AUTO ? JITKV_MLA_PATH_VEC : p->path;
  const int sms = device_info(p->device).sms;
  auto s = static_cast<cudaStream_t>(stream);
  jitkv::cuda::DeviceGuard guard(p->device);
  if (path == JITKV_MLA_PATH_TMA) {
    if (jitkv_set_mla_kv_buffer_tma_blocker(p) != nullptr) return cudaErrorInvalidValue;
    return dispatch_tma<kTmaBuilt>(*p, sms, s);
  }
  return dispatch<false>(*p, vector_path_vec_bytes(*p), sms, s);
}

extern "C" const char* jitkv_set_mla_kv_buffer_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
