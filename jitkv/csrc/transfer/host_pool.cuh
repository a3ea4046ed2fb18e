// The CUDA bindings' rule for a host pool beside a GPU: page-locked memory (torch's pin_memory()), which
// the copy engines read and write at full speed and, under UVA, the device reaches at the host
// address; a pageable pointer would stage through a bounce buffer (the copy engine) or fault (a kernel).
#pragma once

#include <cuda_runtime.h>

#include "jitkv/check.h"
#include "transfer/parse.h"

namespace jitkv::transfer {

// ValueError unless t (when a host tensor) is pinned; with `mapped`, also mapped at its own address
// on the current device (what the SM kernel dereferences).
inline void check_host_pool(const char* op, const char* name, const TensorView& t, DLDevice dev, bool mapped) {
  if (!is_host(t) || t.numel() == 0) return;
  const void* ptr = data_ptr(t);
  cudaPointerAttributes attr = {};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear it: this is the caller's error, not a sticky one
    attr.type = cudaMemoryTypeUnregistered;
  }
  if (attr.type != cudaMemoryTypeHost) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a pinned CPU tensor (pin_memory()) for a copy with "
                              << device_str(dev) << ", got one that is not pinned";
  }
  if (mapped && attr.devicePointer != ptr) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": the CUDA kernel needs pinned memory mapped at its host "
                              << "address on " << device_str(dev) << " (UVA)";
  }
}

}  // namespace jitkv::transfer
