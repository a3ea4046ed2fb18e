// tvm-ffi binding of set_mla_kv_buffer's copy ("auto") on CUDA: parses and checks the arguments
// (parse.h), picks the kernel (copy.cuh), the widest vector the alignments allow and the launch shape,
// and launches on the caller's current stream (jitkv/cuda/launch.cuh: PDL from sm_90, device guard).
// Exported as set_mla_kv_buffer; the fp8 formats have their own module (set_mla_kv_buffer_fp8_cuda.cu).
//
// Template arguments (JitSpec args): JITKV_NOPE_BYTES / JITKV_ROPE_BYTES, the source bytes of the row
// parts; JITKV_KERNEL, a codes::MlaKernel: auto (the measured choice below), or forced: TMA bulk store
// (ValueError where not possible: below sm_90, destination not 16-byte aligned), vector (bulk) kernel,
// latency kernel (ValueError for rows it cannot take); JITKV_PDL, 0 launches without programmatic
// dependent launch. The forced kernels and PDL off exist for the tests and the benchmark's per-kernel
// rows.
//
// Path choice (measured under CUDA-graph replay, 8 layers of caches far larger than L2, random unique
// slots: docs/performance.md "set_mla_kv_buffer kernels"):
//  - the latency kernel (one warp per row, or per 16-byte register of a row up to kSplitRowsMax rows;
//    slot and row loads together) is the fastest at every n, level with the others only where random
//    row writes bound every kernel. Auto takes it whenever the rows are 16-byte aligned and fit in
//    registers;
//  - warps per block of the latency kernel: 4 up to 8 rows per SM, 8 beyond (jitkv/cuda/launch.cuh
//    latency_warps_per_block). A row split across warps (n <= kSplitRowsMax) makes a block of its own;
//  - the TMA bulk store is never faster than the vector kernel (its rows pass through shared
//    memory), so it is only there when forced;
//  - the vector (bulk) kernel, 2 warps per block and 2 rows per warp step above 16 rows per SM,
//    takes unaligned views and rows too long for registers.
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <type_traits>

#include "jitkv/codes.h"
#include "jitkv/cuda/launch.cuh"
#include "mla/copy.cuh"
#include "mla/launch.cuh"
#include "mla/parse.h"

namespace {

using namespace jitkv::mla;
using jitkv::codes::MlaKernel;
using jitkv::cuda::DeviceInfo;
using tvm::ffi::TensorView;

constexpr const char* kOp = "set_mla_kv_buffer";
constexpr int kNope = JITKV_NOPE_BYTES;
constexpr int kRope = JITKV_ROPE_BYTES;
static_assert(kNope >= 0 && kRope >= 0 && kNope + kRope > 0, "empty row");
constexpr bool kPdl = JITKV_PDL != 0;
constexpr MlaKernel kKernel = static_cast<MlaKernel>(JITKV_KERNEL);
static_assert(JITKV_KERNEL >= 0 && JITKV_KERNEL <= 3, "JITKV_KERNEL: a codes::MlaKernel");

// TMA kernels are only built when every architecture this module targets has cp.async.bulk.
constexpr int min_target_arch() {
  constexpr int archs[] = {__CUDA_ARCH_LIST__};
  int m = archs[0];
  for (int a : archs) m = a < m ? a : m;
  return m;
}
constexpr bool kTmaBuilt = min_target_arch() >= 900 && (kNope + kRope) % 16 == 0;

// Largest power of two <= 16 dividing every value: the lowest set bit of their OR.
int common_pow2(uint64_t bits) {
  bits |= 16;
  return static_cast<int>(bits & (~bits + 1));
}

// Widest vector for the loads of k_nope / k_rope (and, on the vector path, for the destination).
int source_vec_bytes(const MlaParams& p) {
  return common_pow2(kNope | kRope | u(p.nope) | u(p.nope_row_stride) | u(p.rope) | u(p.rope_row_stride));
}
int vector_path_vec_bytes(const MlaParams& p) {
  return common_pow2(source_vec_bytes(p) | u(p.dst) | u(p.dst_row_stride));
}

// Tuned shapes exist for 16-byte vectors on rows that fit in registers; anything else (misaligned
// tensors, very long rows) runs one row per warp step.
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
template <int V>
constexpr bool two_rows() {
  if constexpr (tunable<V>()) {
    return 2 * RowShape<kNope, kRope, V>::kIters <= 6;
  } else {
    return false;
  }
}
constexpr int kBulkWarps = 2;  // warps per block of the bulk kernels: best or within noise at every n
// Up to this many rows the latency kernel gives each 16-byte register of a row its own warp (3 warps
// per 512+64 bf16 row): a shorter chain per warp; from 128 rows on the extra warps cost more than it
// saves (docs/performance.md "kSplitRowsMax").
constexpr int64_t kSplitRowsMax = 32;
constexpr int kTwoRowsPerSm = 16;  // above this many rows per SM a bulk warp takes two rows per step

// The latency kernel takes 16-byte aligned rows that fit in registers, at every n (launch shapes:
// launch_latency_warps).
bool latency_fits(const MlaParams& p) { return tunable<16>() && vector_path_vec_bytes(p) == 16; }

// A row's warps (kRowWarps > 1) make a block of their own; one warp per row runs in blocks of
// latency_warps_per_block. The kernel takes the compact block (MlaRowArgs) where the call fits it.
template <int kRowWarps, typename TLoc>
cudaError_t launch_latency_warps(const MlaParams& p, const DeviceInfo& info, cudaStream_t stream) {
  const int64_t warps = p.n * kRowWarps;
  const int wpb = kRowWarps > 1 ? kRowWarps : jitkv::cuda::latency_warps_per_block(warps, info.sms);
  const dim3 grid(static_cast<unsigned>((warps + wpb - 1) / wpb)), block(32 * wpb);
  return with_block(static_cast<const MlaArgs&>(p), row_args, [&](const auto& args) {
    using Args = std::decay_t<decltype(args)>;
    return jitkv::cuda::launch(set_mla_kv_buffer_latency_kernel<kNope, kRope, kRowWarps, TLoc, Args>, grid, block,
                               stream, kPdl && info.pdl(), args);
  });
}

// The 16-byte registers a row takes (RowShape named through V: widths that do not split into V-byte
// vectors never instantiate it).
template <int V>
constexpr int row_registers() {
  if constexpr (tunable<V>()) {
    return RowShape<kNope, kRope, V>::kIters;
  } else {
    return 0;
  }
}

template <typename TLoc>
cudaError_t launch_latency(const MlaParams& p, const DeviceInfo& info, cudaStream_t stream) {
  if constexpr (tunable<16>()) {
    constexpr int kRegs = row_registers<16>();
    if (kRegs > 1 && p.n <= kSplitRowsMax) return launch_latency_warps<kRegs, TLoc>(p, info, stream);
    return launch_latency_warps<1, TLoc>(p, info, stream);
  } else {
    return cudaErrorInvalidValue;
  }
}

template <bool kTma, int V, int R, typename TLoc>
cudaError_t launch_bulk(const MlaParams& p, const DeviceInfo& info, cudaStream_t stream) {
  const int64_t rows_per_block = static_cast<int64_t>(kBulkWarps) * R;
  // Rows past a full grid are taken by the grid-stride loop.
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((p.n + rows_per_block - 1) / rows_per_block, 0x7fffffff));
  return jitkv::cuda::launch(set_mla_kv_buffer_kernel<kNope, kRope, V, kBulkWarps, R, kTma, TLoc>, dim3(blocks),
                             dim3(kBulkWarps * 32), stream, kPdl && info.pdl(), p);
}

// The widest vector V <= vec dividing both parts (widths that don't are never instantiated), then the
// rows per warp step.
template <bool kTma, int V, typename TLoc>
cudaError_t launch_bulk_vec(const MlaParams& p, int vec, const DeviceInfo& info, cudaStream_t stream) {
  if constexpr (kNope % V != 0 || kRope % V != 0) {
    return launch_bulk_vec<kTma, V / 2, TLoc>(p, vec, info, stream);
  } else {
    if constexpr (V > 1) {
      if (vec < V) return launch_bulk_vec<kTma, V / 2, TLoc>(p, vec, info, stream);
    }
    if constexpr (two_rows<V>()) {
      if (p.n > kTwoRowsPerSm * static_cast<int64_t>(info.sms)) return launch_bulk<kTma, V, 2, TLoc>(p, info, stream);
    }
    return launch_bulk<kTma, V, 1, TLoc>(p, info, stream);
  }
}

// The TMA kernels exist only in modules whose every target has cp.async.bulk.
template <bool kTma>
cudaError_t launch_bulk_kernel(const MlaParams& p, const DeviceInfo& info, cudaStream_t stream) {
  if constexpr (kTma && !kTmaBuilt) {
    return cudaErrorInvalidValue;
  } else {
    const int vec = kTma ? source_vec_bytes(p) : vector_path_vec_bytes(p);
    return p.loc_i64 ? launch_bulk_vec<kTma, 16, int64_t>(p, vec, info, stream)
                     : launch_bulk_vec<kTma, 16, int32_t>(p, vec, info, stream);
  }
}

// nullptr when the TMA kernel can run these arguments, else the reason it cannot.
const char* tma_blocker(const MlaParams& p, const DeviceInfo& info) {
  if ((kNope + kRope) % 16 != 0) return "row bytes (nope + rope) are not a multiple of 16";
  if (!kTmaBuilt) return "module not compiled for sm_90 or newer";
  if (info.major < 9) return "device is below sm_90 (no TMA bulk copy)";
  if (u(p.dst) % 16 != 0) return "kv_buffer data pointer is not 16-byte aligned";
  if (u(p.dst_row_stride) % 16 != 0) return "kv_buffer row stride is not a multiple of 16 bytes";
  return nullptr;
}

// The module's kernel for these arguments: auto takes the latency kernel whenever it fits (see the top
// of this file); a forced kernel that cannot run them raises ValueError.
MlaKernel pick_kernel(const MlaParams& p, const DeviceInfo& info) {
  if (kKernel == MlaKernel::kAuto) return latency_fits(p) ? MlaKernel::kLatency : MlaKernel::kVector;
  if (kKernel == MlaKernel::kLatency && !latency_fits(p)) {
    TVM_FFI_THROW(ValueError) << kOp << ": the latency kernel needs 16-byte aligned rows that fit in registers";
  }
  if (kKernel == MlaKernel::kTma) {
    if (const char* why = tma_blocker(p, info)) {
      TVM_FFI_THROW(ValueError) << kOp << ": the TMA bulk-store kernel is not possible: " << why;
    }
  }
  return kKernel;
}

void set_mla_kv_buffer(TensorView kv_buffer, TensorView loc, TensorView k_nope, TensorView k_rope, int64_t skip_slot) {
  const MlaParams p = parse_params(kOp, kv_buffer, loc, k_nope, k_rope, skip_slot);
  check_cuda(kOp, p);
  check_row_bytes(kOp, p, kNope, kRope);
  if (p.n == 0) return;
  const int device = p.device.device_id;
  const DeviceInfo info = jitkv::cuda::device_info(device);
  const MlaKernel kernel = pick_kernel(p, info);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  cudaError_t err;
  if constexpr (kKernel == MlaKernel::kTma) {  // only TMA modules carry the TMA kernels
    err = launch_bulk_kernel<true>(p, info, stream);
  } else if (kernel == MlaKernel::kLatency) {
    err = p.loc_i64 ? launch_latency<int64_t>(p, info, stream) : launch_latency<int32_t>(p, info, stream);
  } else {
    err = launch_bulk_kernel<false>(p, info, stream);
  }
  jitkv::cuda::check_launch(kOp, err);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_mla_kv_buffer, set_mla_kv_buffer);
