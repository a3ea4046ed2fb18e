// Plain C interface between the tvm-ffi binding (set_mla_kv_buffer_cuda.cc, g++) and the CUDA
// launcher (set_mla_kv_buffer_cuda.cu, nvcc), so the binding compiles without any CUDA header.
#pragma once

#include <stdint.h>

extern "C" {

enum { JITKV_MLA_PATH_AUTO = 0, JITKV_MLA_PATH_TMA = 1, JITKV_MLA_PATH_VEC = 2, JITKV_MLA_PATH_LATENCY = 3 };

struct JitkvMlaLaunchParams {
  void* dst;
  const void* nope;
  const void* rope;
  const void* loc;
  int64_t n, num_slots, dst_row_stride, nope_row_stride, rope_row_stride, skip_slot;  // strides: bytes
  int32_t loc_i64;
  int32_t device;
  int32_t path;             // JITKV_MLA_PATH_*
  int32_t pdl;              // 1: launch with programmatic dependent launch (SM90+; ignored below)
};

// nullptr when the TMA path can run these arguments on p->device, else the reason it cannot.
const char* jitkv_set_mla_kv_buffer_tma_blocker(const JitkvMlaLaunchParams* p);
// Launches on `stream` (a cudaStream_t of p->device) with p->device current (restored after);
// returns a cudaError_t. A forced TMA path must have passed jitkv_set_mla_kv_buffer_tma_blocker
// (else cudaErrorInvalidValue); a forced latency path needs 16-byte aligned rows that fit in
// registers (else cudaErrorInvalidValue).
int jitkv_set_mla_kv_buffer_launch(const JitkvMlaLaunchParams* p, void* stream);
// cudaGetErrorString of a value returned by the launcher.
const char* jitkv_set_mla_kv_buffer_error_string(int err);

}  // extern "C"
