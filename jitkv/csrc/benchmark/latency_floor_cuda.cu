// Benchmark-only kernel and its tvm-ffi binding: the fastest KV write the contract allows. One thread
// waits for the previous kernel (PDL), loads loc[0] and 16 source bytes together (one memory round
// trip), lets the next kernel launch, and stores the bytes at that slot if it is in range: the floor
// under any set_mla_kv_buffer / store_cache / DSv4 writer launch at n = 1.
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

#include "jitkv/check.h"
#include "jitkv/cuda/launch.cuh"

namespace {

using jitkv::data_ptr;
using tvm::ffi::TensorView;

__global__ void latency_floor_kernel(const int64_t* loc, const uint4* src, char* dst, int64_t row_bytes,
                                     int64_t num_rows) {
  if (threadIdx.x != 0) return;
  jitkv::cuda::pdl_wait();
  const int64_t slot = jitkv::cuda::load(loc);
  const uint4 v = jitkv::cuda::load(src);
  jitkv::cuda::pdl_launch_dependents();
  if (slot >= 0 && slot < num_rows) *reinterpret_cast<uint4*>(dst + slot * row_bytes) = v;
}

bool on_cuda(const TensorView& t) { return t.device().device_type == kDLCUDA; }
int64_t nbytes(const TensorView& t) { return t.numel() * jitkv::elem_bytes(t.dtype()); }

// dst: [rows, >= 16 bytes] with 16-byte aligned rows; loc: int64, >= 1 entry; src: >= 16 aligned bytes.
void latency_floor(TensorView dst, TensorView loc, TensorView src) {
  const int64_t row_bytes = dst.ndim() == 2 ? dst.stride(0) * jitkv::elem_bytes(dst.dtype()) : 0;
  const bool dst_ok = on_cuda(dst) && dst.ndim() == 2 && dst.size(1) * jitkv::elem_bytes(dst.dtype()) >= 16 &&
                      row_bytes % 16 == 0 && jitkv::aligned16(data_ptr(dst));
  const bool loc_ok = on_cuda(loc) && loc.dtype().code == kDLInt && loc.dtype().bits == 64 && loc.numel() >= 1;
  if (!dst_ok || !loc_ok || !on_cuda(src) || nbytes(src) < 16 || !jitkv::aligned16(data_ptr(src))) {
    TVM_FFI_THROW(ValueError) << "latency_floor: expected CUDA tensors dst [rows, >= 16 bytes] (16-byte aligned "
                              << "rows), loc int64 [>= 1], src of >= 16 bytes (16-byte aligned)";
  }
  const int device = dst.device().device_id;
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(device);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  jitkv::cuda::check_launch(
      "latency_floor", jitkv::cuda::launch(latency_floor_kernel, dim3(1), dim3(32), stream, info.pdl(),
                                           static_cast<const int64_t*>(static_cast<void*>(data_ptr(loc))),
                                           reinterpret_cast<const uint4*>(data_ptr(src)), data_ptr(dst), row_bytes,
                                           dst.size(0)));
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(latency_floor, latency_floor);
