// Argument parsing for set_mla_kv_buffer, shared by the CPU and CUDA bindings (device-agnostic).
// kv_buffer[loc[i], :nope] = k_nope[i]; kv_buffer[loc[i], nope:nope+rope] = k_rope[i].
// Shapes: kv_buffer [S, W] or [S, 1, W]; k_nope [n', nope] or [n', 1, nope]; k_rope likewise;
// W >= nope + rope; n' >= n = loc.numel(). One dtype everywhere (bf16, fp16, fp32, uint8, float8).
// Only the innermost dim must be contiguous: row strides are arbitrary and returned in bytes.
// The caller checks the device type (CPU vs CUDA); this header checks that all tensors share one.
#pragma once

#include "jitkv/check.h"

namespace jitkv {

struct MlaArgs {
  char* dst;
  const char* nope;
  const char* rope;
  const void* loc;
  bool loc_i64;
  int64_t n, num_slots, dst_row_stride, nope_row_stride, rope_row_stride;  // strides in bytes
  int64_t nope_bytes, rope_bytes, skip_slot;
  DLDevice device;
};

namespace mla_detail {


// A 2-D [rows, width] or 3-D [rows, 1, width] tensor: returns width.
inline int64_t row_width(const char* op, const char* name, const TensorView& t, const char* want) {
  if (t.ndim() == 2 || (t.ndim() == 3 && t.size(1) == 1)) return t.size(t.ndim() - 1);
  TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected shape " << want << ", got "
                            << shape_str(t);
  return 0;
}

}  // namespace mla_detail

inline MlaArgs parse_mla_args(const char* op, const TensorView& kv_buffer, const TensorView& loc,
                              const TensorView& k_nope, const TensorView& k_rope, int64_t skip_slot) {
  DLDataType dt = kv_buffer.dtype();
  if (!is_copy_dtype(dt)) {
    TVM_FFI_THROW(TypeError) << op << ": kv_buffer: expected dtype bfloat16, float16, float32, uint8, "
                             << "float8_e4m3fn or float8_e5m2, got " << dt;
  }
  DLDevice dev = kv_buffer.device();
  check_device(op, "k_nope", k_nope, dev, "kv_buffer");
  check_device(op, "k_rope", k_rope, dev, "kv_buffer");
  check_device(op, "loc", loc, dev, "kv_buffer");
  check_same_dtype(op, "k_nope", k_nope, dt, "kv_buffer");
  check_same_dtype(op, "k_rope", k_rope, dt, "kv_buffer");

  int64_t width = mla_detail::row_width(op, "kv_buffer", kv_buffer, "[num_slots, W] or [num_slots, 1, W]");
  int64_t nope = mla_detail::row_width(op, "k_nope", k_nope, "[n, nope] or [n, 1, nope]");
  int64_t rope = mla_detail::row_width(op, "k_rope", k_rope, "[n, rope] or [n, 1, rope]");
  check_last_dim_contiguous(op, "kv_buffer", kv_buffer);
  check_last_dim_contiguous(op, "k_nope", k_nope);
  check_last_dim_contiguous(op, "k_rope", k_rope);
  if (width < nope + rope) {
    TVM_FFI_THROW(ValueError) << op << ": kv_buffer: row width " << width << " is smaller than nope + rope = "
                              << nope << " + " << rope;
  }

  bool loc_i64 = check_index(op, "loc", loc);
  int64_t n = loc.numel();
  check_rows_at_least(op, "k_nope", k_nope, n, "loc");
  check_rows_at_least(op, "k_rope", k_rope, n, "loc");

  int64_t es = elem_bytes(dt);
  MlaArgs a;
  a.dst = data_ptr(kv_buffer);
  a.nope = data_ptr(k_nope);
  a.rope = data_ptr(k_rope);
  a.loc = data_ptr(loc);
  a.loc_i64 = loc_i64;
  a.n = n;
  a.num_slots = kv_buffer.size(0);
  a.dst_row_stride = kv_buffer.stride(0) * es;
  a.nope_row_stride = k_nope.stride(0) * es;
  a.rope_row_stride = k_rope.stride(0) * es;
  a.nope_bytes = nope * es;
  a.rope_bytes = rope * es;
  a.skip_slot = skip_slot;
  a.device = dev;
  return a;
}

}  // namespace jitkv
