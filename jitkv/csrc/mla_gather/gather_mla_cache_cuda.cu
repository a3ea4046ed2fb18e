// tvm-ffi binding of gather_mla_cache on CUDA: parses and checks the arguments (parse.h), checks them
// against the module's template arguments and launches the kernel (gather.cuh) on the caller's current
// stream (jitkv/cuda/launch.cuh: PDL from sm_90, device guard).
//
// Template arguments (JitSpec args): JITKV_FORMAT, the codes::KvFormat this module reads (copy, e4m3,
// e5m2, fp8_ds_mla: the codes::DsMla record); JITKV_OUT_BYTES, the output row in bytes (a multiple of
// 16).
//
// The grid covers out.shape[0] rows (never cu_seq_lens[num_reqs], which lives on the device): one warp
// per kTok rows, kWarps warps per CTA, at most 2^31 - 1 CTAs (the kernel's grid-stride loop takes any
// rest). Launch constants (gather.cuh): 4 warps of 2 rows, chosen by the register budget, as the DSv4
// gather's measured best: 32-40 registers (ptxas, sm_90a), so 12-16 CTAs and 2 x 1152 bytes in flight
// per warp, far above what hides DRAM latency at full bandwidth.
// python -m jitkv.benchmark --op gather_mla_cache times them against a contiguous copy of the same
// bytes (16 requests x 4096 tokens of 576 bf16, copied and from fp8_ds_mla).
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>

#include "jitkv/codes.h"
#include "jitkv/cuda/launch.cuh"
#include "mla_gather/gather.cuh"
#include "mla_gather/params.h"
#include "mla_gather/parse.h"

namespace {

using namespace jitkv::mla_gather;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;

constexpr const char* kOp = "gather_mla_cache";
constexpr KvFormat kFormat = static_cast<KvFormat>(JITKV_FORMAT);
constexpr int kOutBytes = JITKV_OUT_BYTES;
static_assert(JITKV_FORMAT >= 0 && JITKV_FORMAT <= 3, "JITKV_FORMAT: a codes::KvFormat");
static_assert(kOutBytes > 0 && kOutBytes % 16 == 0, "JITKV_OUT_BYTES: whole 16-byte vectors");

uint64_t u(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); }
uint64_t u(int64_t x) { return static_cast<uint64_t>(x); }

// The kernel's vectors: 16-byte output stores; cache loads of 16 bytes (copy, fp8_ds_mla) or 8 bytes
// (a per-tensor fp8 format reads 8 values per output vector).
void check_module(const GatherParams& p) {
  if (p.device.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << kOp << ": out: expected a CUDA tensor, got " << jitkv::device_str(p.device);
  }
  if (p.format != kFormat || p.out_row_bytes != kOutBytes) {
    TVM_FFI_THROW(ValueError) << kOp << ": out: this module was compiled for kv_cache_dtype '" << format_name(kFormat)
                              << "' and rows of " << kOutBytes << " bytes, got '" << format_name(p.format) << "' and "
                              << p.out_row_bytes;
  }
  if ((u(p.out) | u(p.out_row_stride)) % 16 != 0) {
    TVM_FFI_THROW(ValueError) << kOp << ": out: the CUDA kernel needs a 16-byte aligned data pointer and row stride";
  }
  const uint64_t in_align = kFormat == KvFormat::kE4M3 || kFormat == KvFormat::kE5M2 ? 8 : 16;
  if ((u(p.cache) | u(p.block_stride) | u(p.token_stride)) % in_align != 0) {
    TVM_FFI_THROW(ValueError) << kOp << ": kv_cache: the CUDA kernel needs a " << in_align
                              << "-byte aligned data pointer, block stride and token stride";
  }
}

void gather_mla_cache(TensorView out, TensorView kv_cache, TensorView block_table, TensorView cu_seq_lens,
                      Optional<TensorView> seq_starts, int64_t format, Optional<TensorView> scale, double scale_value) {
  const GatherParams p =
      parse_params(kOp, out, kv_cache, block_table, cu_seq_lens, seq_starts, format, scale, scale_value);
  check_module(p);
  if (p.rows == 0 || p.num_reqs == 0) return;
  const int device = p.device.device_id;
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(device);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  constexpr int64_t kTile = int64_t(kWarps) * kTok;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((p.rows + kTile - 1) / kTile, 0x7fffffff));
  const cudaError_t err = jitkv::cuda::launch(gather_mla_cache_kernel<kFormat, kOutBytes>, dim3(blocks),
                                              dim3(kWarps * 32), stream, info.pdl(), p);
  jitkv::cuda::check_launch(kOp, err);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gather_mla_cache, gather_mla_cache);
