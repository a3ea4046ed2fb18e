// tvm-ffi binding of transfer_pages on CUDA: parses and checks the arguments (parse.h: parse_params, and
// cuda_device's device rule), checks every host pool is pinned and mapped at its own address (UVA),
// checks the views against the module's vector width, and launches the SM copy kernel (kernels.cuh) on
// the caller's current stream of the ids' device (jitkv/cuda/launch.cuh: device guard, and PDL from
// sm_90 as every jitkv kernel: the kernel waits for the previous grid before its first access).
//
// Template argument (JitSpec args): JITKV_VEC, the kernel's vector bytes (16, 4 or 1); the views must
// have every base, stride and page_bytes a multiple of it (jitkv/ops/transfer.py variant picks it).
//
// The grid is bounded: max_sms (at most the device's SMs) x kCtasPerSm CTAs of kWarps warps, fewer
// when there are fewer (pair, layer) runs than warps; the kernel's grid-stride loop takes the rest.
// The bound exists because this copy runs beside the forward pass (a HiCache load or offload
// overlapping compute): it must not take the SMs the model's kernels need, and a host<->device copy is
// bound by the link, which a few SMs' loads in flight saturate (kWarps x kCtasPerSm warps per SM, each
// lane kUnroll 16-byte vectors: 64 KiB per SM in flight). No host sync: ids past their pools are
// skipped on the device.
#include <cuda_runtime.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>

#include "jitkv/check.h"
#include "jitkv/cuda/launch.cuh"
#include "transfer/kernels.cuh"
#include "transfer/params.h"
#include "transfer/parse.h"

namespace {

using namespace jitkv::transfer;
using tvm::ffi::TensorView;

constexpr const char* kOp = "transfer_pages";
constexpr int kVec = JITKV_VEC;
static_assert(kVec == 16 || kVec == 4 || kVec == 1, "JITKV_VEC: 16, 4 or 1");

uint64_t u(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); }
uint64_t u(int64_t x) { return static_cast<uint64_t>(x); }

// A host pool must be page-locked memory that the current device reaches at the same address (what
// torch's pin_memory() gives under UVA); a pageable pointer would fault in the kernel.
void check_host_pool(const char* name, const TensorView& t, DLDevice dev) {
  if (!is_host(t) || t.numel() == 0) return;
  const void* ptr = jitkv::data_ptr(t);
  cudaPointerAttributes attr = {};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: this is the caller's error, not a sticky one
    attr.type = cudaMemoryTypeUnregistered;
  }
  if (attr.type != cudaMemoryTypeHost) {
    TVM_FFI_THROW(ValueError) << kOp << ": " << name << ": expected a pinned CPU tensor (pin_memory()) for a copy with "
                              << jitkv::device_str(dev) << ", got one that is not pinned";
  }
  if (attr.devicePointer != ptr) {
    TVM_FFI_THROW(ValueError) << kOp << ": " << name << ": the CUDA kernel needs pinned memory mapped at its host "
                              << "address on " << jitkv::device_str(dev) << " (UVA)";
  }
}

void check_module(const TransferParams& p) {
  if ((u(p.src.base) | u(p.dst.base) | u(p.src.layer_stride) | u(p.src.page_stride) | u(p.dst.layer_stride) |
       u(p.dst.page_stride) | u(p.page_bytes)) %
          kVec !=
      0) {
    TVM_FFI_THROW(ValueError) << kOp << ": src: this module copies " << kVec << "-byte vectors: every data pointer, "
                              << "layer and page stride, and the page bytes must be multiples of " << kVec;
  }
}

void transfer_pages(TensorView src, TensorView dst, TensorView src_pages, TensorView dst_pages, int64_t max_sms) {
  const DLDevice dev = cuda_device(kOp, src, dst, src_pages, dst_pages);
  const TransferParams p = parse_params(kOp, src, dst, src_pages, dst_pages);
  if (max_sms < 1) {
    TVM_FFI_THROW(ValueError) << kOp << ": max_sms: expected an int >= 1, got " << max_sms;
  }
  check_module(p);
  const int64_t items = p.n * p.num_layers;
  if (items == 0 || p.page_bytes == 0 || p.src.num_pages == 0 || p.dst.num_pages == 0) return;
  const int device = dev.device_id;
  jitkv::cuda::DeviceGuard guard(device);
  check_host_pool("src", src, dev);
  check_host_pool("dst", dst, dev);
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(device);
  const int64_t sms = std::min<int64_t>(max_sms, std::max(info.sms, 1));
  const int64_t blocks = std::min<int64_t>(sms * kCtasPerSm, (items + kWarps - 1) / kWarps);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  const cudaError_t err = jitkv::cuda::launch(transfer_pages_kernel<kVec>, dim3(static_cast<unsigned>(blocks)),
                                              dim3(kWarps * 32), stream, info.pdl(), p);
  jitkv::cuda::check_launch(kOp, err);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(transfer_pages, transfer_pages);
