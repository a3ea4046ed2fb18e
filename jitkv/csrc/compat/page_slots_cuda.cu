// FlashInfer's page-table indexing as jitkv slots, in one launch: slot[t] for every token by
// jitkv/page_table.h's rule (cuda/paged.cuh page_table_slot), the values of page_slots' torch form
// (jitkv/compat/flashinfer.py).
// One thread per token. The slots feed the next kernel (the shim's store_cache or rope_store_cache), so
// the launch has PDL and triggers the next one as soon as its loads are issued: under CUDA-graph replay
// the pair costs about one launch more than the write alone, where the torch form's dozen index ops
// cost a launch each (docs/performance.md "FlashInfer page slots").
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

#include "jitkv/check.h"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/paged.cuh"
#include "jitkv/page_table.h"

namespace {

using jitkv::data_ptr;
using jitkv::PageTable;
using tvm::ffi::TensorView;

struct PageSlotsParams {
  PageTable table;
  int64_t* slots;
  int64_t n;
};

__global__ void page_slots_kernel(const __grid_constant__ PageSlotsParams p) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  jitkv::cuda::pdl_wait();
  if (t >= p.n) {
    jitkv::cuda::pdl_launch_dependents();
    return;
  }
  const jitkv::cuda::TableEntries entries(p.table, t);
  jitkv::cuda::pdl_launch_dependents();
  p.slots[t] = entries.slot(p.table);
}

constexpr const char* kOp = "page_slots";

// batch_indices, positions [n], kv_indices [>= 0], kv_indptr [>= 1] (parse_page_table), on the CUDA device
// of the int64 slots [n].
void page_slots(TensorView batch_indices, TensorView positions, TensorView kv_indices, TensorView kv_indptr,
                TensorView slots, int64_t page_size) {
  const bool slots_i64 = jitkv::check_index(kOp, "slots", slots);
  if (slots.device().device_type != kDLCUDA || !slots_i64) {
    TVM_FFI_THROW(ValueError) << kOp << ": slots: expected an int64 CUDA tensor";
  }
  const int64_t n = slots.size(0);
  const PageSlotsParams p{jitkv::cuda::parse_page_table(kOp, batch_indices, positions, kv_indices, kv_indptr, page_size,
                                                        n, slots.device(), "slots"),
                          reinterpret_cast<int64_t*>(data_ptr(slots)), n};
  if (n == 0) return;
  const int device = slots.device().device_id;
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(device);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  constexpr int kThreads = 128;
  const dim3 grid(static_cast<unsigned>((n + kThreads - 1) / kThreads));
  jitkv::cuda::check_launch(kOp, jitkv::cuda::launch(page_slots_kernel, grid, dim3(kThreads), stream, info.pdl(), p));
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(page_slots, page_slots);
