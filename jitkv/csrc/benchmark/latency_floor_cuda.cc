// tvm-ffi binding of the benchmark's latency-floor kernel (latency_floor_cuda.cu).
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

#include "jitkv/check.h"

extern "C" int jitkv_latency_floor_launch(int device, void* stream, const void* loc, const void* src, void* dst,
                                          int64_t row_bytes, int64_t num_rows);

namespace {

using jitkv::data_ptr;
using tvm::ffi::TensorView;

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
  const int err = jitkv_latency_floor_launch(device, TVMFFIEnvGetStream(kDLCUDA, device), data_ptr(loc),
                                             data_ptr(src), data_ptr(dst), row_bytes, dst.size(0));
  if (err != 0) TVM_FFI_THROW(RuntimeError) << "latency_floor: kernel launch failed (cudaError " << err << ")";
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(latency_floor, latency_floor);
