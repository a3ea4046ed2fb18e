// The CUDA bindings' rules for a host pool beside a GPU: page-locked memory (torch's pin_memory()), which
// the copy engines read and write at full speed and, under UVA, the device reaches at the host
// address; a pageable pointer would stage through a bounce buffer (the copy engine) or fault (a kernel).
// And which mechanism takes host ids (copy_engines_take).
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

// Whether a graph is being captured on `stream` (the caller's current stream).
inline bool stream_capturing(const char* op, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: torch's next check would report it as its own
    TVM_FFI_THROW(RuntimeError) << op << ": cudaStreamIsCapturing failed: " << cudaGetErrorString(err);
  }
  return capture != cudaStreamCaptureStatusNone;
}

// Whether host ids of pages of `page_bytes` go to the copy engines rather than the SM kernel: pages of
// ce_min_page_bytes or more (the Python side's CE_MIN_PAGE_BYTES: a copy engine pays a fixed cost per
// run that small pages do not amortize), and no graph being captured on `stream`, the caller's current
// stream (a captured batch is one memcpy node per run, which replays at half the SM kernel's rate:
// docs/performance.md "Host ids in the parameter block"). Both bindings apply it, so that each hands
// the other's calls back unread; the stream is asked only about pages large enough (true: it was
// asked, and no graph is captured).
inline bool copy_engines_take(const char* op, int64_t page_bytes, int64_t ce_min_page_bytes, cudaStream_t stream) {
  return page_bytes >= ce_min_page_bytes && !stream_capturing(op, stream);
}

}  // namespace jitkv::transfer
