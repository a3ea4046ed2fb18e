// FlashInfer's page-table indexing as jitkv slots, in one launch (jitkv/compat/flashinfer.py
// page_slots: the contract and its torch form, which this kernel matches value for value):
//   slot[t] = kv_indices[e] * page_size + pos mod page_size,  e = kv_indptr[b] + floor(pos / page_size)
// for b = batch_indices[t] >= 0 and pos = positions[t]; slot[t] = -1 for b < 0 or an empty kv_indices.
// b past kv_indptr and e outside kv_indices are clamped into them: nothing is read outside a table (what
// such a slot then names is the caller's; jitkv's writes drop slots outside the cache).
// One thread per token. The slots feed the next kernel (the shim's store_cache or rope_store_cache), so
// the launch has PDL and triggers the next one as soon as its loads are issued: under CUDA-graph replay
// the pair costs about one launch more than the write alone, where the torch form's dozen index ops
// cost a launch each (docs/performance.md "FlashInfer page slots").
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

#include "jitkv/check.h"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/vec.cuh"

namespace {

using jitkv::data_ptr;
using jitkv::cuda::load_index;
using tvm::ffi::TensorView;

struct PageSlotsParams {
  const void *batch_indices, *positions, *kv_indices, *kv_indptr;
  int64_t* slots;
  int64_t n, page_size, num_indices, num_indptr;
  int32_t batch_i64, pos_i64, indices_i64, indptr_i64;
};

__device__ __forceinline__ int64_t clamp_index(int64_t i, int64_t size) { return i < 0 ? 0 : i >= size ? size - 1 : i; }

__global__ void page_slots_kernel(const __grid_constant__ PageSlotsParams p) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  jitkv::cuda::pdl_wait();
  if (t >= p.n) {
    jitkv::cuda::pdl_launch_dependents();
    return;
  }
  const int64_t b = load_index(p.batch_indices, p.batch_i64, t);
  const int64_t pos = load_index(p.positions, p.pos_i64, t);
  jitkv::cuda::pdl_launch_dependents();
  int64_t slot = -1;
  if (b >= 0 && p.num_indices > 0) {
    int64_t page_of = pos / p.page_size, row = pos % p.page_size;
    if (row < 0) {  // floor division, as the torch form's
      row += p.page_size;
      page_of -= 1;
    }
    const int64_t e = load_index(p.kv_indptr, p.indptr_i64, clamp_index(b, p.num_indptr)) + page_of;
    slot = load_index(p.kv_indices, p.indices_i64, clamp_index(e, p.num_indices)) * p.page_size + row;
  }
  p.slots[t] = slot;
}

constexpr const char* kOp = "page_slots";

// batch_indices, positions [n], kv_indices [>= 0], kv_indptr [>= 1]: int32 or int64, contiguous
// (check_index), on one CUDA device; slots int64 [n] on it. The Python caller checks what a user passes;
// these checks keep a direct call from reading or writing out of bounds.
void page_slots(TensorView batch_indices, TensorView positions, TensorView kv_indices, TensorView kv_indptr,
                TensorView slots, int64_t page_size) {
  const bool batch_i64 = jitkv::check_index(kOp, "batch_indices", batch_indices);
  const bool pos_i64 = jitkv::check_index(kOp, "positions", positions);
  const bool indices_i64 = jitkv::check_index(kOp, "kv_indices", kv_indices);
  const bool indptr_i64 = jitkv::check_index(kOp, "kv_indptr", kv_indptr);
  const bool slots_i64 = jitkv::check_index(kOp, "slots", slots);
  const int64_t n = batch_indices.size(0);
  bool on_cuda = true;
  for (const TensorView* t : {&batch_indices, &positions, &kv_indices, &kv_indptr, &slots}) {
    on_cuda = on_cuda && t->device().device_type == kDLCUDA;
  }
  if (!on_cuda || positions.size(0) != n || kv_indptr.size(0) < 1 || page_size < 1 || !slots_i64 ||
      slots.size(0) != n) {
    TVM_FFI_THROW(ValueError) << kOp << ": expected CUDA batch_indices and positions [n], kv_indices [m], kv_indptr "
                              << "[>= 1], int64 slots [n] and page_size >= 1";
  }
  if (n == 0) return;
  const int device = slots.device().device_id;
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(device);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  const PageSlotsParams p{data_ptr(batch_indices),
                          data_ptr(positions),
                          data_ptr(kv_indices),
                          data_ptr(kv_indptr),
                          reinterpret_cast<int64_t*>(data_ptr(slots)),
                          n,
                          page_size,
                          kv_indices.size(0),
                          kv_indptr.size(0),
                          batch_i64,
                          pos_i64,
                          indices_i64,
                          indptr_i64};
  constexpr int kThreads = 128;
  const dim3 grid(static_cast<unsigned>((n + kThreads - 1) / kThreads));
  jitkv::cuda::check_launch(kOp, jitkv::cuda::launch(page_slots_kernel, grid, dim3(kThreads), stream, info.pdl(), p));
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(page_slots, page_slots);
