// Benchmark-only: vLLM's swap_blocks way of moving KV blocks between a GPU and pinned host memory, one
// cudaMemcpyAsync per (block, layer) on the current stream, ids read on the host: the baseline the
// transfer section times jitkv's transfer_pages against (python -m jitkv.benchmark --op transfer).
// Pools as transfer_pages takes them ([L, P, *page], dense pages, any dim 0 / 1 strides); no checks
// beyond the parser's, as the engine's loop has none.
#include <cuda_runtime.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

#include "transfer/params.h"
#include "transfer/parse.h"
#include "transfer/plan.h"

namespace {

using namespace jitkv::transfer;
using tvm::ffi::TensorView;

void block_memcpy(TensorView src, TensorView dst, TensorView src_pages, TensorView dst_pages, int64_t device) {
  const TransferParams p = parse_params("block_memcpy", src, dst, src_pages, dst_pages);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, static_cast<int32_t>(device)));
  for (int64_t l = 0; l < p.num_layers; ++l) {
    for (int64_t i = 0; i < p.n; ++i) {
      const int64_t s = host_id(p.src_pages, i, p.src_i64), d = host_id(p.dst_pages, i, p.dst_i64);
      const cudaError_t err =
          cudaMemcpyAsync(p.dst.at(l, d), p.src.at(l, s), static_cast<size_t>(p.page_bytes), cudaMemcpyDefault, stream);
      if (err != cudaSuccess) TVM_FFI_THROW(RuntimeError) << "block_memcpy: " << cudaGetErrorString(err);
    }
  }
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(block_memcpy, block_memcpy);
