// tvm-ffi binding of the indexer K cache ops on CUDA: parses and checks the arguments (parse.h),
// refuses views the vector kernels cannot take, picks the kernel (kernels.cuh) and the launch shape, and
// launches on the caller's current stream (jitkv/cuda/launch.cuh: PDL from sm_90, device guard). The
// record is codes::Indexer; the module has no template arguments.
//
// The kernels move 16-byte vectors: k rows, cache blocks and dst_k rows must be 16-byte aligned (base
// and stride), dst_scale rows 4-byte aligned. ops/indexer.py dispatches other views to the Triton
// kernels from the arguments (recorded in backend_info and warned about once); called directly, the
// binding refuses them with a ValueError.
//
// Launch shapes: the writer runs a grid of exactly ceil(n / 2) warps (half a warp per token) in blocks
// of jitkv/cuda/launch.cuh latency_warps_per_block, the choice set_mla_kv_buffer's latency kernel
// measured for the same one-warp-per-row pattern; the gather runs 4-warp CTAs of 16 tokens over
// dst_k.shape[0].
// python -m jitkv.benchmark --op indexer re-measures both.
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "indexer/kernels.cuh"
#include "indexer/params.h"
#include "indexer/parse.h"
#include "jitkv/codes.h"
#include "jitkv/cuda/launch.cuh"

namespace {

using namespace jitkv::indexer;
using jitkv::codes::SrcDtype;
using jitkv::cuda::DeviceInfo;
using tvm::ffi::TensorView;

constexpr const char* kWriteOp = "indexer_k_quant_and_cache";
constexpr const char* kGatherOp = "gather_indexer_k_quant_cache";
constexpr int kGatherTokensPerCta = kGatherWarps * 32 / kGatherLanes;

void check_cuda(const char* op, DLDevice dev) {
  if (dev.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected a CUDA tensor, got " << jitkv::device_str(dev);
  }
}

// Base and row stride (of rows > 1) multiples of `bytes`, else ValueError. ops/indexer.py sends views
// that fail this to Triton before calling; the check keeps a direct call from misaligned vectors.
void require_aligned(const char* op, const char* name, const void* base, int64_t stride, int64_t rows, int bytes) {
  if (reinterpret_cast<uintptr_t>(base) % bytes == 0 && (rows <= 1 || stride % bytes == 0)) return;
  TVM_FFI_THROW(ValueError) << op << ": " << name << ": the CUDA kernels need a " << bytes
                            << "-byte aligned base and row stride";
}

template <SrcDtype kSrc, typename TIdx>
cudaError_t launch_write(const WriteParams& p, const DeviceInfo& info, cudaStream_t stream) {
  const int64_t warps = (p.n + 1) / 2;
  const int per_block = jitkv::cuda::latency_warps_per_block(warps, info.sms);
  const auto blocks = static_cast<unsigned>((warps + per_block - 1) / per_block);
  return jitkv::cuda::launch(indexer_write_kernel<kSrc, TIdx>, dim3(blocks), dim3(32 * per_block), stream, info.pdl(),
                             p);
}

void indexer_k_quant_and_cache(TensorView k, TensorView kv_cache, TensorView slot_mapping, int64_t block_size,
                               int64_t scale_fmt) {
  const WriteParams p = parse_write(kWriteOp, k, kv_cache, slot_mapping, block_size, scale_fmt);
  check_cuda(kWriteOp, p.device);
  if (p.n == 0) return;
  require_aligned(kWriteOp, "kv_cache", p.cache, p.block_stride, p.num_slots / p.block_size, 16);
  require_aligned(kWriteOp, "k", p.k, p.k_row_stride, p.n, 16);
  const int device = p.device.device_id;
  const DeviceInfo info = jitkv::cuda::device_info(device);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  cudaError_t err;
  if (p.k_f16) {
    err = p.slot_i64 ? launch_write<SrcDtype::kF16, int64_t>(p, info, stream)
                     : launch_write<SrcDtype::kF16, int32_t>(p, info, stream);
  } else {
    err = p.slot_i64 ? launch_write<SrcDtype::kBF16, int64_t>(p, info, stream)
                     : launch_write<SrcDtype::kBF16, int32_t>(p, info, stream);
  }
  jitkv::cuda::check_launch(kWriteOp, err);
}

void gather_indexer_k_quant_cache(TensorView kv_cache, TensorView dst_k, TensorView dst_scale, TensorView block_table,
                                  TensorView cu_seq_lens, int64_t block_size) {
  const GatherParams p = parse_gather(kGatherOp, kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size);
  check_cuda(kGatherOp, p.device);
  if (p.num_tokens == 0 || p.batch == 0) return;
  require_aligned(kGatherOp, "kv_cache", p.cache, p.block_stride, p.num_blocks, 16);
  require_aligned(kGatherOp, "dst_k", p.dst_k, p.dst_k_stride, p.num_tokens, 16);
  require_aligned(kGatherOp, "dst_scale", p.dst_scale, p.dst_scale_stride, p.num_tokens, 4);
  const int device = p.device.device_id;
  const DeviceInfo info = jitkv::cuda::device_info(device);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  const auto blocks = static_cast<unsigned>((p.num_tokens + kGatherTokensPerCta - 1) / kGatherTokensPerCta);
  jitkv::cuda::check_launch(kGatherOp, jitkv::cuda::launch(indexer_gather_kernel, dim3(blocks), dim3(kGatherWarps * 32),
                                                           stream, info.pdl(), p));
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(indexer_k_quant_and_cache, indexer_k_quant_and_cache);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gather_indexer_k_quant_cache, gather_indexer_k_quant_cache);
