// set_mla_kv_buffer's parameter blocks, shared by host and device: what the kernels read, each kernel
// all of its block. A kernel warms every 64-byte line of its block before the PDL wait
// (jitkv/cuda/launch.cuh warm_params), so a block holds nothing its kernel does not read (host-only
// fields: parse.h MlaParams).
#pragma once

#include <cstdint>

namespace jitkv::mla {

// The copy kernels' block. Strides in bytes; rows are never written where slot < 0, slot == skip_slot
// or slot >= num_slots.
struct MlaArgs {
  char* dst;
  const char* nope;
  const char* rope;
  const void* loc;
  int64_t n, num_slots, dst_row_stride, nope_row_stride, rope_row_stride, skip_slot;  // strides: bytes
};

// The fp8 kernels' block.
struct MlaFp8Args : MlaArgs {
  const float* scale_ptr;  // per-tensor fp8 scale: a 1-element float32 tensor on the device, or nullptr
  float scale;             // the scale when scale_ptr is nullptr
};

// The latency kernels' compact blocks: MlaArgs in 48 bytes (MlaFp8Args in 64), for the calls whose
// values fit (launch.cuh fits_row_args): n and num_slots below 2^31, source row strides in 16-byte
// units below 1 MiB, the destination's in 8-byte units, and a skip_slot that is no slot of the buffer
// (the default -1), which the kernel then need not test. Under CUDA-graph replay a launch costs more
// the larger its parameter block; the fp8 kernels gain less than the copy, their conversion chain
// dominating (docs/performance.md "MlaRowArgs").
struct MlaRowArgs {
  char* dst;
  const char* nope;
  const char* rope;
  const void* loc;
  int32_t n, num_slots;
  uint16_t nope_stride16, rope_stride16;  // source row strides / 16
  uint32_t dst_stride8;                   // destination row stride / 8
};

struct MlaFp8RowArgs : MlaRowArgs {
  const float* scale_ptr;
  float scale;
};

}  // namespace jitkv::mla
