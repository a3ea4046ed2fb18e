// tvm-ffi binding of set_mla_kv_buffer's fp8 writers on CUDA (fp8.cuh): bf16/fp16 rows quantized to
// e4m3 / e5m2 with a per-tensor scale or to the fp8_ds_mla record. Parses and checks the arguments
// (parse.h), picks the kernel and the launch shape, and launches on the caller's current stream
// (jitkv/cuda/launch.cuh: PDL from sm_90, device guard). Exported as set_mla_kv_buffer_fp8.
//
// Template arguments (JitSpec args): JITKV_KV_FORMAT, the codes::KvFormat written (e4m3, e5m2 or
// fp8_ds_mla); JITKV_SRC_DTYPE, the codes::SrcDtype of the sources (bf16 or fp16); JITKV_NOPE_BYTES /
// JITKV_ROPE_BYTES, the source bytes of the row parts; JITKV_KERNEL, a codes::MlaFp8Kernel (a forced
// kernel that cannot run the arguments raises ValueError); JITKV_PDL, 0 launches without programmatic
// dependent launch.
//
// Kernels:
//  - the fast kernel for 16-byte aligned sources, destination rows 8-byte aligned (16 for fp8_ds_mla)
//    and row parts of whole 16-byte vectors: "split" gives each row two warps (half the conversion
//    chain per warp, for a lone row's latency), "row" one warp (twice the bytes in flight per warp);
//  - "lanes" (e4m3 / e5m2, the fast kernel's alignment): one source vector per lane, a block of one
//    row's warps (3 for 512+64 bf16);
//  - the generic kernel for anything else (any alignment, any row length).
// Auto takes lanes up to kLanesRowsMax rows (e4m3 / e5m2), split up to kSplitRowsPerSm rows per SM, row
// beyond. Split runs in blocks of 4 warps (one SM converting 8 warps' rows is issue-bound; many one-warp
// blocks cost more to schedule), row in blocks of 8. The measurements: docs/performance.md
// "set_mla_kv_buffer_fp8 kernels".
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <type_traits>

#include "jitkv/codes.h"
#include "jitkv/cuda/launch.cuh"
#include "mla/fp8.cuh"
#include "mla/launch.cuh"
#include "mla/parse.h"
#include "mla/rows.cuh"

namespace {

using namespace jitkv::mla;
using jitkv::codes::MlaFp8Kernel;
using jitkv::codes::SrcDtype;
using jitkv::cuda::DeviceInfo;
using tvm::ffi::TensorView;

constexpr const char* kOp = "set_mla_kv_buffer";
constexpr int kNope = JITKV_NOPE_BYTES;
constexpr int kRope = JITKV_ROPE_BYTES;
static_assert(kNope >= 0 && kRope >= 0 && kNope + kRope > 0, "empty row");
constexpr bool kPdl = JITKV_PDL != 0;
constexpr KvFormat kFormat = static_cast<KvFormat>(JITKV_KV_FORMAT);
constexpr SrcDtype kSrc = static_cast<SrcDtype>(JITKV_SRC_DTYPE);
static_assert(kFormat == KvFormat::kE4M3 || kFormat == KvFormat::kE5M2 || kFormat == KvFormat::kDsMla,
              "JITKV_KV_FORMAT: an fp8 codes::KvFormat");
static_assert(kSrc == SrcDtype::kBF16 || kSrc == SrcDtype::kF16, "JITKV_SRC_DTYPE: codes::SrcDtype bf16 or fp16");
constexpr MlaFp8Kernel kKernel = static_cast<MlaFp8Kernel>(JITKV_KERNEL);
static_assert(JITKV_KERNEL >= 0 && JITKV_KERNEL <= 4, "JITKV_KERNEL: a codes::MlaFp8Kernel");
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

MlaFp8Kernel pick_kernel(const MlaParams& p, const DeviceInfo& info) {
  const bool fast = fast_fits(p);
  if (kKernel == MlaFp8Kernel::kAuto) {
    if (!fast) return MlaFp8Kernel::kGeneric;
    if (kLanesBuilt && p.n <= kLanesRowsMax) return MlaFp8Kernel::kLanes;
    return kSplitBuilt && p.n <= kSplitRowsPerSm * static_cast<int64_t>(info.sms) ? MlaFp8Kernel::kSplit
                                                                                  : MlaFp8Kernel::kRow;
  }
  if ((kKernel == MlaFp8Kernel::kSplit || kKernel == MlaFp8Kernel::kRow || kKernel == MlaFp8Kernel::kLanes) && !fast) {
    TVM_FFI_THROW(ValueError) << kOp << ": the fast fp8 kernel needs 16-byte aligned sources and destination rows "
                              << (kFormat == KvFormat::kDsMla ? 16 : 8) << "-byte aligned, in rows of 16-byte vectors";
  }
  if (kKernel == MlaFp8Kernel::kSplit && !kSplitBuilt) {
    TVM_FFI_THROW(ValueError) << kOp << ": the split fp8 kernel needs nope and rope parts of an even number of "
                              << "16-byte vectors";
  }
  if (kKernel == MlaFp8Kernel::kLanes && !kLanesBuilt) {
    TVM_FFI_THROW(ValueError) << kOp << ": the lanes fp8 kernel writes e4m3 / e5m2 rows, not fp8_ds_mla records";
  }
  return kKernel;
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
      return jitkv::cuda::launch(set_mla_kv_buffer_fp8_kernel<kFormat, kSrc, kNope, kRope, kRowWarps, TLoc, Args>, grid,
                                 block, stream, kPdl && info.pdl(), args);
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
cudaError_t launch(MlaFp8Kernel kernel, const MlaParams& p, const DeviceInfo& info, cudaStream_t stream) {
  switch (kernel) {
    case MlaFp8Kernel::kSplit:
      return launch_fast<2, TLoc>(p, info, stream);
    case MlaFp8Kernel::kRow:
      return launch_fast<1, TLoc>(p, info, stream);
    case MlaFp8Kernel::kLanes:
      return launch_lanes<TLoc>(p, info, stream);
    default:
      return launch_generic<TLoc>(p, info, stream);
  }
}

void check_module(const MlaParams& p) {
  check_cuda(kOp, p);
  if (p.kv_format != kFormat) {
    TVM_FFI_THROW(ValueError) << kOp << ": kv_cache_dtype: this module was compiled for " << format_name(kFormat)
                              << ", got " << format_name(p.kv_format);
  }
  if ((p.dtype.code == kDLBfloat) != (kSrc == SrcDtype::kBF16)) {
    TVM_FFI_THROW(ValueError) << kOp << ": cache_k_nope: this module was compiled for "
                              << (kSrc == SrcDtype::kBF16 ? "bfloat16" : "float16") << " sources, got " << p.dtype;
  }
  check_row_bytes(kOp, p, kNope, kRope);
}

void set_mla_kv_buffer_fp8(TensorView kv_buffer, TensorView loc, TensorView k_nope, TensorView k_rope,
                           int64_t skip_slot, int64_t kv_format, tvm::ffi::Optional<TensorView> scale,
                           double scale_value) {
  const MlaParams p = parse_fp8_params(kOp, kv_buffer, loc, k_nope, k_rope, skip_slot, kv_format, scale, scale_value);
  check_module(p);
  if (p.n == 0) return;
  const int device = p.device.device_id;
  const DeviceInfo info = jitkv::cuda::device_info(device);
  const MlaFp8Kernel kernel = pick_kernel(p, info);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  const cudaError_t err =
      p.loc_i64 ? launch<int64_t>(kernel, p, info, stream) : launch<int32_t>(kernel, p, info, stream);
  jitkv::cuda::check_launch(kOp, err);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_mla_kv_buffer_fp8, set_mla_kv_buffer_fp8);
