// Launcher for the set_mla_kv_buffer kernels (set_mla_kv_buffer.cuh), one module per (nope, rope) byte
// sizes given as -DJITKV_NOPE_BYTES / -DJITKV_ROPE_BYTES. Picks the kernel, the widest vector the
// alignments allow and the launch shape, and launches (with programmatic dependent launch unless told
// not to) with the tensors' device current.
//
// Path choice, measured on an NVIDIA H100 (132 SMs), CUDA-graph replay, 8 layers of 2^19-row bf16
// 512+64 caches, random unique slots, n = 1 ... 262,144 (python -m jitkv.benchmark --op
// set_mla_kv_buffer has the "jit latency / vector / TMA" rows that re-measure it):
//  - the latency kernel (one warp per row, slot and row loads together) is the fastest at every n:
//    0.35-0.45 us ahead of the vector (bulk) kernel up to n = 2048, 0.4 us at 4096, 0.5 us at 16,384,
//    within noise at 262,144, where random 1152-byte row writes bound every kernel. Auto takes it
//    whenever the rows are 16-byte aligned and fit in registers;
//  - warps per block of the latency kernel, A/B over 3 interleaved rounds: 4 up to 8 rows per SM
//    (n = 1024: 1.37 us against 1.53 with 8 and sglang's 1.51), 8 beyond (n = 2048: 2.37 against
//    2.48 with 4); 1 per block while n <= SMs was 0.02-0.06 us slower at n <= 256;
//  - the TMA bulk store is never faster than the vector kernel (its rows pass through shared
//    memory), so it is only there when forced;
//  - the vector (bulk) kernel, 2 warps per block and 2 rows per warp step above 16 rows per SM,
//    takes unaligned views and rows too long for registers.
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

// Launch shape: warps per block, rows per warp step.
struct Shape {
  int warps;
  int rows;
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
constexpr Shape kFixedShape{2, 1};

Shape pick_shape(const JitkvMlaLaunchParams& p, int vec, int sms) {
  if (vec != 16 || !tunable<16>()) return kFixedShape;
  return Shape{kTunedWarps, p.n > 16 * static_cast<int64_t>(sms) && two_rows() ? 2 : 1};
}

// The latency kernel takes 16-byte aligned rows that fit in registers, at every n, in blocks of 4 warps
// up to 8 rows per SM and 8 warps beyond (see the top of this file).
bool latency_fits(const JitkvMlaLaunchParams& p) { return tunable<16>() && vector_path_vec_bytes(p) == 16; }
int latency_warps(int64_t n, int sms) { return n <= 8 * static_cast<int64_t>(sms) ? 4 : 8; }

template <typename TLoc>
cudaError_t launch_latency_kernel(const MlaKernelParams& k, int warps, bool pdl, cudaStream_t stream) {
  if constexpr (tunable<16>()) {
    const unsigned blocks = static_cast<unsigned>((k.n + warps - 1) / warps);
    return jitkv::cuda::launch(set_mla_kv_buffer_latency_kernel<kNope, kRope, TLoc>, dim3(blocks), dim3(32 * warps),
                                stream, pdl, k);
  } else {
    return cudaErrorInvalidValue;
  }
}

struct Launch {
  MlaKernelParams k;
  Shape shape;
  unsigned blocks;
  bool pdl;
  cudaStream_t stream;
};

template <bool kTma, int V, int W, int R, typename TLoc>
cudaError_t launch_kernel(const Launch& l) {
  return jitkv::cuda::launch(set_mla_kv_buffer_kernel<kNope, kRope, V, W, R, kTma, TLoc>, dim3(l.blocks),
                              dim3(W * 32), l.stream, l.pdl, l.k);
}

template <bool kTma, int V, typename TLoc, int W>
cudaError_t dispatch_rows(const Launch& l) {
  if constexpr (two_rows()) {
    if (l.shape.rows == 2) return launch_kernel<kTma, V, W, 2, TLoc>(l);
  }
  return l.shape.rows == 1 ? launch_kernel<kTma, V, W, 1, TLoc>(l) : cudaErrorInvalidValue;
}

template <bool kTma, int V, typename TLoc>
cudaError_t dispatch_shape(const Launch& l) {
  if constexpr (tunable<V>()) {
    return dispatch_rows<kTma, V, TLoc, kTunedWarps>(l);
  } else {
    return launch_kernel<kTma, V, kFixedShape.warps, kFixedShape.rows, TLoc>(l);
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

MlaKernelParams kernel_params(const JitkvMlaLaunchParams& p) {
  return MlaKernelParams{static_cast<char*>(p.dst), static_cast<const char*>(p.nope), static_cast<const char*>(p.rope),
                         p.loc, p.n, p.num_slots, p.dst_row_stride, p.nope_row_stride, p.rope_row_stride, p.skip_slot};
}

bool use_pdl(const JitkvMlaLaunchParams& p) { return p.pdl != 0 && device_info(p.device).major >= 9; }

cudaError_t dispatch_latency(const JitkvMlaLaunchParams& p, cudaStream_t stream) {
  const MlaKernelParams k = kernel_params(p);
  const int w = latency_warps(p.n, device_info(p.device).sms);
  return p.loc_i64 ? launch_latency_kernel<int64_t>(k, w, use_pdl(p), stream)
                   : launch_latency_kernel<int32_t>(k, w, use_pdl(p), stream);
}

template <bool kTma>
cudaError_t dispatch(const JitkvMlaLaunchParams& p, int vec, int sms, cudaStream_t stream) {
  Launch l;
  l.k = kernel_params(p);
  l.shape = pick_shape(p, vec, sms);
  const int64_t rows_per_block = static_cast<int64_t>(l.shape.warps) * l.shape.rows;
  // Rows past a full grid are taken by the grid-stride loop.
  l.blocks = static_cast<unsigned>(std::min<int64_t>((p.n + rows_per_block - 1) / rows_per_block, 0x7fffffff));
  l.pdl = use_pdl(p);
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
  const int sms = device_info(p->device).sms;
  int path = p->path;
  if (path == JITKV_MLA_PATH_AUTO) {  // see the top of this file
    path = latency_fits(*p) ? JITKV_MLA_PATH_LATENCY : JITKV_MLA_PATH_VEC;
  }
  auto s = static_cast<cudaStream_t>(stream);
  jitkv::cuda::DeviceGuard guard(p->device);
  if (path == JITKV_MLA_PATH_LATENCY) {
    return latency_fits(*p) ? dispatch_latency(*p, s) : cudaErrorInvalidValue;
  }
  if (path == JITKV_MLA_PATH_TMA) {
    if (jitkv_set_mla_kv_buffer_tma_blocker(p) != nullptr) return cudaErrorInvalidValue;
    return dispatch_tma<kTmaBuilt>(*p, sms, s);
  }
  return dispatch<false>(*p, vector_path_vec_bytes(*p), sms, s);
}

extern "C" const char* jitkv_set_mla_kv_buffer_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
