// What set_mla_kv_buffer's two CUDA bindings (set_mla_kv_buffer_cuda.cu, set_mla_kv_buffer_fp8_cuda.cu)
// share: the compact parameter blocks from the call's and the launch with either, the checks of the
// call against the module.
#pragma once

#include <tvm/ffi/error.h>

#include <cstdint>

#include "jitkv/check.h"
#include "jitkv/cuda/launch.cuh"
#include "mla/params.h"
#include "mla/parse.h"

namespace jitkv::mla {

inline uint64_t u(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); }
inline uint64_t u(int64_t x) { return static_cast<uint64_t>(x); }

// Whether the compact blocks (params.h MlaRowArgs, MlaFp8RowArgs) hold the call, and their fields from
// the call's.
inline bool fits_row_args(const MlaArgs& p) {
  using cuda::fits_units;
  return p.n <= INT32_MAX && p.num_slots <= INT32_MAX && (p.skip_slot < 0 || p.skip_slot >= p.num_slots) &&
         fits_units(p.nope_row_stride, 16, UINT16_MAX) && fits_units(p.rope_row_stride, 16, UINT16_MAX) &&
         fits_units(p.dst_row_stride, 8, UINT32_MAX);
}

inline MlaRowArgs row_args(const MlaArgs& p) {
  return {p.dst,
          p.nope,
          p.rope,
          p.loc,
          static_cast<int32_t>(p.n),
          static_cast<int32_t>(p.num_slots),
          static_cast<uint16_t>(p.nope_row_stride / 16),
          static_cast<uint16_t>(p.rope_row_stride / 16),
          static_cast<uint32_t>(p.dst_row_stride / 8)};
}

inline MlaFp8RowArgs fp8_row_args(const MlaFp8Args& p) {
  MlaFp8RowArgs r;
  static_cast<MlaRowArgs&>(r) = row_args(p);
  r.scale_ptr = p.scale_ptr;
  r.scale = p.scale;
  return r;
}

// Calls launch(block) with the compact block where the call fits it (to_compact makes it from the
// call's), else with the call's own: every latency kernel is built for both.
template <typename Wide, typename ToCompact, typename Launch>
cudaError_t with_block(const Wide& p, ToCompact to_compact, Launch&& launch) {
  if (fits_row_args(p)) return launch(to_compact(p));
  return launch(p);
}

inline void check_cuda(const char* op, const MlaParams& p) {
  if (p.device.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << op << ": kv_buffer: expected a CUDA tensor, got " << device_str(p.device);
  }
}

// The source bytes per row the module was compiled for.
inline void check_row_bytes(const char* op, const MlaParams& p, int nope_bytes, int rope_bytes) {
  if (p.nope_bytes != nope_bytes || p.rope_bytes != rope_bytes) {
    TVM_FFI_THROW(ValueError) << op << ": cache_k_nope/cache_k_rope: this module was compiled for " << nope_bytes
                              << " + " << rope_bytes << " bytes per row, got " << p.nope_bytes << " + " << p.rope_bytes;
  }
}

}  // namespace jitkv::mla
