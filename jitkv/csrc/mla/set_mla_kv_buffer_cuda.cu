// tvm-ffi binding of set_mla_kv_buffer on CUDA: parses and checks the arguments (set_mla_kv_buffer.cuh),
// picks the kernel, the widest vector the alignments allow and the launch shape, and launches on the
// caller's current stream (jitkv/cuda/launch.cuh: PDL from sm_90, device guard).
//
// Template arguments (JitSpec args): JITKV_KV_FORMAT, the cache format (jitkv/layouts.py codes): 0 builds
// the copy, exported as set_mla_kv_buffer; 1 (e4m3), 2 (e5m2) or 3 (fp8_ds_mla) the quantizing writer of
// that format, exported as set_mla_kv_buffer_fp8 (see its section below), with JITKV_SRC_DTYPE (1 bf16,
// 2 fp16) and the fp8_ds_mla record's layout (JITKV_DSMLA_*). JITKV_NOPE_BYTES / JITKV_ROPE_BYTES, the
// source bytes of the row parts; JITKV_KERNEL, 0 = auto (the measured choice below), for the copy 1 = TMA
// bulk store (ValueError where not possible: below sm_90, destination not 16-byte aligned), 2 = vector
// (bulk) kernel, 3 = latency kernel (ValueError for rows it cannot take); JITKV_PDL, 0 launches without
// programmatic dependent launch. The forced kernels and PDL off exist for the tests and the benchmark's
// per-kernel rows.
//
// Path choice, measured on an NVIDIA H100 (132 SMs), CUDA-graph replay, 8 layers of 2^19-row bf16
// 512+64 caches, random unique slots, n = 1 ... 262,144 (python -m jitkv.benchmark --op
// set_mla_kv_buffer has the "jit latency / vector / TMA" rows that re-measure it):
//  - the latency kernel (one warp per row, or per 16-byte register of a row up to kSplitRowsMax rows;
//    slot and row loads together) is the fastest at every n:
//    0.35-0.45 us ahead of the vector (bulk) kernel up to n = 2048, 0.4 us at 4096, 0.5 us at 16,384,
//    within noise at 262,144, where random 1152-byte row writes bound every kernel. Auto takes it
//    whenever the rows are 16-byte aligned and fit in registers;
//  - warps per block of the latency kernel, A/B over 3 interleaved rounds: 4 up to 8 rows per SM
//    (n = 1024: 1.37 us against 1.53 with 8 and sglang's 1.51), 8 beyond (n = 2048: 2.37 against
//    2.48 with 4); 1 per block while n <= SMs was 0.02-0.06 us slower at n <= 256. A row split across
//    warps (n <= kSplitRowsMax) makes a block of its own (measured with the compact parameter block,
//    set_mla_kv_buffer.cuh MlaRowArgs);
//  - the TMA bulk store is never faster than the vector kernel (its rows pass through shared
//    memory), so it is only there when forced;
//  - the vector (bulk) kernel, 2 warps per block and 2 rows per warp step above 16 rows per SM,
//    takes unaligned views and rows too long for registers.
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <type_traits>

#include "mla/set_mla_kv_buffer.cuh"

#if !defined(JITKV_NOPE_BYTES) || !defined(JITKV_ROPE_BYTES) || !defined(JITKV_KERNEL) || !defined(JITKV_PDL) || \
    !defined(JITKV_KV_FORMAT)
#error "set_mla_kv_buffer_cuda.cu needs -DJITKV_KV_FORMAT, -DJITKV_NOPE_BYTES, -DJITKV_ROPE_BYTES, -DJITKV_KERNEL, -DJITKV_PDL"
#endif

namespace {

using namespace jitkv::mla;
using jitkv::cuda::DeviceInfo;
using tvm::ffi::TensorView;

constexpr const char* kOp = "set_mla_kv_buffer";
constexpr int kNope = JITKV_NOPE_BYTES;
constexpr int kRope = JITKV_ROPE_BYTES;
static_assert(kNope >= 0 && kRope >= 0 && kNope + kRope > 0, "empty row");
constexpr bool kPdl = JITKV_PDL != 0;

uint64_t u(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); }
uint64_t u(int64_t x) { return static_cast<uint64_t>(x); }

// Whether the compact blocks (set_mla_kv_buffer.cuh MlaRowArgs, MlaFp8RowArgs) hold the call, and
// their fields from the call's.
bool fits_row_args(const MlaArgs& p) {
  using jitkv::cuda::fits_units;
  return p.n <= INT32_MAX && p.num_slots <= INT32_MAX && (p.skip_slot < 0 || p.skip_slot >= p.num_slots) &&
         fits_units(p.nope_row_stride, 16, UINT16_MAX) && fits_units(p.rope_row_stride, 16, UINT16_MAX) &&
         fits_units(p.dst_row_stride, 8, UINT32_MAX);
}

MlaRowArgs row_args(const MlaArgs& p) {
  return {p.dst,
          p.nope,
          p.rope,
          p.loc,
          static_cast<int32_t>(p.n),
          static_cast<int32_t>(p.num_slots),
          static_cast<uint16_t>(p.nope_row_stride / 16),
          static_cast<uint16_t>(p.rope_row_stride / 16),
          static_cast<uint32_t>(p.dst_row_stride / 8)};
}

// Calls launch(block) with the compact block where the call fits it (to_compact makes it from the
// call's), else with the call's own: every latency kernel is built for both.
template <typename Wide, typename ToCompact, typename Launch>
cudaError_t with_block(const Wide& p, ToCompact to_compact, Launch&& launch) {
  if (fits_row_args(p)) return launch(to_compact(p));
  return launch(p);
}

#if JITKV_KV_FORMAT == 0
// ---- the copy ----
enum class Kernel { kAuto = 0, kTma = 1, kVector = 2, kLatency = 3 };
constexpr Kernel kKernel = static_cast<Kernel>(JITKV_KERNEL);
static_assert(JITKV_KERNEL >= 0 && JITKV_KERNEL <= 3, "JITKV_KERNEL: 0 auto, 1 TMA, 2 vector, 3 latency");

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
constexpr int kBulkWarps = 2;     // warps per block of the bulk kernels: best or within noise at every n
// Up to this many rows the latency kernel gives each 16-byte register of a row its own warp (3 warps
// per 512+64 bf16 row). NVIDIA H100, graph replay, same run, one warp per row vs one per register:
// n = 1 / 2 / 8 / 32 0.893 / 0.900 / 0.913 / 0.945 us vs 0.871 / 0.893 / 0.911 / 0.936; n = 128 / 2048
// 0.981 / 2.31 vs 1.024 / 2.54: from 128 rows on the extra warps cost more than the shorter chain saves.
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

template <typename TLoc>
cudaError_t launch_latency(const MlaParams& p, const DeviceInfo& info, cudaStream_t stream) {
  if constexpr (tunable<16>()) {
    constexpr int kRegs = RowShape<kNope, kRope, 16>::kIters;
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
Kernel pick_kernel(const MlaParams& p, const DeviceInfo& info) {
  if (kKernel == Kernel::kAuto) return latency_fits(p) ? Kernel::kLatency : Kernel::kVector;
  if (kKernel == Kernel::kLatency && !latency_fits(p)) {
    TVM_FFI_THROW(ValueError) << kOp << ": the latency kernel needs 16-byte aligned rows that fit in registers";
  }
  if (kKernel == Kernel::kTma) {
    if (const char* why = tma_blocker(p, info)) {
      TVM_FFI_THROW(ValueError) << kOp << ": the TMA bulk-store kernel is not possible: " << why;
    }
  }
  return kKernel;
}

void check_module(const MlaParams& p) {
  if (p.device.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << kOp << ": kv_buffer: expected a CUDA tensor, got " << jitkv::device_str(p.device);
  }
  if (p.nope_bytes != kNope || p.rope_bytes != kRope) {
    TVM_FFI_THROW(ValueError) << kOp << ": cache_k_nope/cache_k_rope: this module was compiled for " << kNope << " + " << kRope
                              << " bytes per row, got " << p.nope_bytes << " + " << p.rope_bytes;
  }
}

void set_mla_kv_buffer(TensorView kv_buffer, TensorView loc, TensorView k_nope, TensorView k_rope,
                       int64_t skip_slot) {
  const MlaParams p = parse_params(kOp, kv_buffer, loc, k_nope, k_rope, skip_slot);
  check_module(p);
  if (p.n == 0) return;
  const int device = p.device.device_id;
  const DeviceInfo info = jitkv::cuda::device_info(device);
  const Kernel kernel = pick_kernel(p, info);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  cudaError_t err;
  if constexpr (kKernel == Kernel::kTma) {  // only TMA modules carry the TMA kernels
    err = launch_bulk_kernel<true>(p, info, stream);
  } else if (kernel == Kernel::kLatency) {
    err = p.loc_i64 ? launch_latency<int64_t>(p, info, stream) : launch_latency<int32_t>(p, info, stream);
  } else {
    err = launch_bulk_kernel<false>(p, info, stream);
  }
  jitkv::cuda::check_launch(kOp, err);
}

#else
// ---- the fp8 writer (JITKV_KV_FORMAT 1 e4m3, 2 e5m2, 3 fp8_ds_mla; set_mla_kv_buffer.cuh) ----
#if !defined(JITKV_SRC_DTYPE) || !defined(JITKV_DSMLA_BYTES)
#error "fp8 modules need -DJITKV_SRC_DTYPE and the fp8_ds_mla record's layout (-DJITKV_DSMLA_*)"
#endif
// Kernels (JITKV_KERNEL: 0 auto, 1 split, 2 row, 3 generic, 4 lanes; a forced kernel that cannot run
// the arguments raises ValueError):
//  - the fast kernel for 16-byte aligned sources, destination rows 8-byte aligned (16 for fp8_ds_mla)
//    and row parts of whole 16-byte vectors: "split" gives each row two warps (half the conversion
//    chain per warp, for a lone row's latency), "row" one warp (twice the bytes in flight per warp);
//  - "lanes" (e4m3 / e5m2, the fast kernel's alignment): one source vector per lane, a block of one
//    row's warps (3 for 512+64 bf16);
//  - the generic kernel for anything else (any alignment, any row length).
// Auto takes lanes up to kLanesRowsMax rows (e4m3 / e5m2), split up to 8 rows per SM, row beyond.
// Split runs in blocks of 4 warps, row in blocks of 8. Measured on an NVIDIA H100, 512+64 bf16 ->
// e4m3, CUDA-graph replay (python -m jitkv.benchmark --op set_mla_kv_buffer has the "jit lanes / split
// / row / generic" rows):
//  - lanes vs split, same run: n = 1 / 4 / 8 / 16 / 32 / 64 / 128 0.894 / 0.904 / 0.919 / 0.928 / 0.954
//    / 1.025 / 1.070 vs 0.904 / 0.952 / 0.969 / 0.965 / 0.970 / 1.005 / 1.113 us (the bf16 copy 0.809 /
//    0.841 / 0.857 / 0.865 / 0.878 / 0.873 / 0.945); at 512 / 1024 lanes 1.32 / 1.99 vs 1.25 / 1.48;
//  - split at n = 16 / 64 / 512 / 1024 0.99 / 1.04 / 1.23 / 1.42 us in blocks of 4 warps, 1.06 / 1.09
//    / 1.43 / 1.58 in blocks of 8, 1.04 / 1.13 / 2.00 / 3.28 in blocks of 1 (one SM converting 8
//    warps' rows is issue-bound; many one-warp blocks cost more to schedule); row at n = 2048 1.86 us
//    against split's 2.08.
constexpr KvFormat kFormat = static_cast<KvFormat>(JITKV_KV_FORMAT);
constexpr Src16 kSrc = static_cast<Src16>(JITKV_SRC_DTYPE);
static_assert(JITKV_KV_FORMAT >= 1 && JITKV_KV_FORMAT <= 3, "JITKV_KV_FORMAT: 1 e4m3, 2 e5m2, 3 fp8_ds_mla");
static_assert(JITKV_SRC_DTYPE == 1 || JITKV_SRC_DTYPE == 2, "JITKV_SRC_DTYPE: 1 bf16, 2 fp16");
enum class Fp8Kernel { kAuto = 0, kSplit = 1, kRow = 2, kGeneric = 3, kLanes = 4 };
constexpr Fp8Kernel kKernel = static_cast<Fp8Kernel>(JITKV_KERNEL);
static_assert(JITKV_KERNEL >= 0 && JITKV_KERNEL <= 4, "JITKV_KERNEL: 0 auto, 1 split, 2 row, 3 generic, 4 lanes");
constexpr bool kFastBuilt = kNope % 16 == 0 && kRope % 16 == 0;
constexpr bool kSplitBuilt = kFastBuilt && fp8_row_splits<kNope, kRope>();
constexpr int kSplitBlockWarps = 4, kRowBlockWarps = 8;
constexpr int kSplitRowsPerSm = 8;
constexpr int64_t kLanesRowsMax = 32;
constexpr int kLanesWarps = ((kNope + kRope) / 16 + 31) / 32;  // per row, and per block (RowShape<.., 16>::kIters)
constexpr bool kLanesBuilt = kFastBuilt && kFormat != KvFormat::kDsMla && kLanesWarps <= 8;  // __launch_bounds__

// Whether the fast kernel's vectors fit these tensors.
bool fast_fits(const MlaParams& p) {
  const uint64_t src = u(p.nope) | u(p.nope_row_stride) | (kRope ? u(p.rope) | u(p.rope_row_stride) : 0);
  const uint64_t dst_align = kFormat == KvFormat::kDsMla ? 16 : 8;
  return kFastBuilt && src % 16 == 0 && (u(p.dst) | u(p.dst_row_stride)) % dst_align == 0;
}

Fp8Kernel pick_kernel(const MlaParams& p, const DeviceInfo& info) {
  const bool fast = fast_fits(p);
  if (kKernel == Fp8Kernel::kAuto) {
    if (!fast) return Fp8Kernel::kGeneric;
    if (kLanesBuilt && p.n <= kLanesRowsMax) return Fp8Kernel::kLanes;
    return kSplitBuilt && p.n <= kSplitRowsPerSm * static_cast<int64_t>(info.sms) ? Fp8Kernel::kSplit
                                                                                  : Fp8Kernel::kRow;
  }
  if ((kKernel == Fp8Kernel::kSplit || kKernel == Fp8Kernel::kRow || kKernel == Fp8Kernel::kLanes) && !fast) {
    TVM_FFI_THROW(ValueError) << kOp << ": the fast fp8 kernel needs 16-byte aligned sources and destination rows "
                              << (kFormat == KvFormat::kDsMla ? 16 : 8) << "-byte aligned, in rows of 16-byte vectors";
  }
  if (kKernel == Fp8Kernel::kSplit && !kSplitBuilt) {
    TVM_FFI_THROW(ValueError) << kOp << ": the split fp8 kernel needs nope and rope parts of an even number of "
                              << "16-byte vectors";
  }
  if (kKernel == Fp8Kernel::kLanes && !kLanesBuilt) {
    TVM_FFI_THROW(ValueError) << kOp << ": the lanes fp8 kernel writes e4m3 / e5m2 rows, not fp8_ds_mla records";
  }
  return kKernel;
}

// The compact fp8 block from the call's (fits_row_args says when it holds it).
MlaFp8RowArgs fp8_row_args(const MlaFp8Args& p) {
  MlaFp8RowArgs r;
  static_cast<MlaRowArgs&>(r) = row_args(p);
  r.scale_ptr = p.scale_ptr;
  r.scale = p.scale;
  return r;
}

template <int kRowWarps, typename TLoc>
cudaError_t launch_fast(const MlaParams& p, const DeviceInfo& info, cudaStream_t stream) {
  if constexpr (!kFastBuilt || (kRowWarps == 2 && !kSplitBuilt)) {
    return cudaErrorInvalidValue;
  } else {
    constexpr int wpb = kRowWarps == 2 ? kSplitBlockWarps : kRowBlockWarps;
    const dim3 grid(static_cast<unsigned>((p.n * kRowWarps + wpb - 1) / wpb)), block(32 * wpb);
    return with_block(static_cast<const MlaFp8Args&>(p), fp8_row_args, [&](const auto& args) {
      using Args = std::decay_t<decltype(args)>;
      return jitkv::cuda::launch(set_mla_kv_buffer_fp8_kernel<kFormat, kSrc, kNope, kRope, kRowWarps, TLoc, Args>,
                                 grid, block, stream, kPdl && info.pdl(), args);
    });
  }
}

// The lanes kernel: a block per row.
template <typename TLoc>
cudaError_t launch_lanes(const MlaParams& p, const DeviceInfo& info, cudaStream_t stream) {
  if constexpr (!kLanesBuilt) {
    return cudaErrorInvalidValue;
  } else {
    const dim3 grid(static_cast<unsigned>(p.n)), block(32 * kLanesWarps);
    return with_block(static_cast<const MlaFp8Args&>(p), fp8_row_args, [&](const auto& args) {
      using Args = std::decay_t<decltype(args)>;
      return jitkv::cuda::launch(set_mla_kv_buffer_fp8_lanes_kernel<kFormat, kSrc, kNope, kRope, TLoc, Args>, grid,
                                 block, stream, kPdl && info.pdl(), args);
    });
  }
}

template <typename TLoc>
cudaError_t launch_generic(const MlaParams& p, const DeviceInfo& info, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>((p.n + kRowBlockWarps - 1) / kRowBlockWarps);
  return jitkv::cuda::launch(set_mla_kv_buffer_fp8_generic_kernel<kFormat, kSrc, kNope, kRope, TLoc>, dim3(blocks),
                             dim3(32 * kRowBlockWarps), stream, kPdl && info.pdl(), p);
}

template <typename TLoc>
cudaError_t launch(Fp8Kernel kernel, const MlaParams& p, const DeviceInfo& info, cudaStream_t stream) {
  switch (kernel) {
    case Fp8Kernel::kSplit: return launch_fast<2, TLoc>(p, info, stream);
    case Fp8Kernel::kRow: return launch_fast<1, TLoc>(p, info, stream);
    case Fp8Kernel::kLanes: return launch_lanes<TLoc>(p, info, stream);
    default: return launch_generic<TLoc>(p, info, stream);
  }
}

void check_module(const MlaParams& p) {
  if (p.device.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << kOp << ": kv_buffer: expected a CUDA tensor, got " << jitkv::device_str(p.device);
  }
  if (p.kv_format != static_cast<int32_t>(kFormat)) {
    TVM_FFI_THROW(ValueError) << kOp << ": kv_cache_dtype: this module was compiled for " << format_name(kFormat)
                              << ", got " << format_name(static_cast<KvFormat>(p.kv_format));
  }
  if ((p.dtype.code == kDLBfloat) != (kSrc == Src16::kBF16)) {
    TVM_FFI_THROW(ValueError) << kOp << ": cache_k_nope: this module was compiled for "
                              << (kSrc == Src16::kBF16 ? "bfloat16" : "float16") << " sources, got " << p.dtype;
  }
  if (p.nope_bytes != kNope || p.rope_bytes != kRope) {
    TVM_FFI_THROW(ValueError) << kOp << ": cache_k_nope/cache_k_rope: this module was compiled for " << kNope << " + " << kRope
                              << " bytes per row, got " << p.nope_bytes << " + " << p.rope_bytes;
  }
}

void set_mla_kv_buffer_fp8(TensorView kv_buffer, TensorView loc, TensorView k_nope, TensorView k_rope,
                           int64_t skip_slot, int64_t kv_format, tvm::ffi::Optional<TensorView> scale,
                           double scale_value) {
  const MlaParams p = parse_fp8_params(kOp, kv_buffer, loc, k_nope, k_rope, skip_slot, kv_format, scale, scale_value);
  check_module(p);
  if (p.n == 0) return;
  const int device = p.device.device_id;
  const DeviceInfo info = jitkv::cuda::device_info(device);
  const Fp8Kernel kernel = pick_kernel(p, info);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  const cudaError_t err = p.loc_i64 ? launch<int64_t>(kernel, p, info, stream) : launch<int32_t>(kernel, p, info, stream);
  jitkv::cuda::check_launch(kOp, err);
}
#endif  // JITKV_KV_FORMAT

}  // namespace

#if JITKV_KV_FORMAT == 0
TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_mla_kv_buffer, set_mla_kv_buffer);
#else
TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_mla_kv_buffer_fp8, set_mla_kv_buffer_fp8);
#endif
