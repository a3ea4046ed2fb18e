// set_mla_kv_buffer's argument parsers, shared by the CUDA bindings (set_mla_kv_buffer_cuda.cu, the copy;
// set_mla_kv_buffer_fp8_cuda.cu, the fp8 writers) and the CPU binding (set_mla_kv_buffer_cpu.cpp): every
// check, with errors naming the argument, and the parameter block of the call.
//
// Shapes: kv_buffer [S, W] or [S, 1, W]; k_nope [n', nope] or [n', 1, nope]; k_rope likewise;
// n' >= n = loc.numel(). Only the innermost dim must be contiguous: row strides are arbitrary and kept
// in bytes. The copy: one dtype everywhere (bf16, fp16, fp32, uint8, float8), W >= nope + rope. The fp8
// formats (codes::KvFormat e4m3, e5m2 with a per-tensor scale; fp8_ds_mla, the codes::DsMla record):
// bf16/fp16 sources into a 1-byte buffer (parse_fp8_params). The bindings check the device type (CPU
// vs CUDA); the parsers check that all tensors share one.
#pragma once

#include <cmath>
#include <cstdint>

#include "jitkv/check.h"
#include "jitkv/codes.h"
#include "mla/params.h"

namespace jitkv::mla {

using codes::DsMla;
using codes::KvFormat;

// The call: the fp8 kernels' block and what only the host needs.
struct MlaParams : MlaFp8Args {
  KvFormat kv_format;
  int64_t nope_bytes, rope_bytes;  // source bytes per row
  DLDevice device;
  DLDataType dtype;  // of k_nope and k_rope
  bool loc_i64;
};

// A 2-D [rows, width] or 3-D [rows, 1, width] tensor: returns width.
inline int64_t row_width(const char* op, const char* name, const TensorView& t, const char* want) {
  if (t.ndim() == 2 || (t.ndim() == 3 && t.size(1) == 1)) return t.size(t.ndim() - 1);
  TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected shape " << want << ", got " << shape_str(t);
  return 0;
}

struct RowWidths {
  int64_t buffer, nope, rope;  // elements
};

// The checks every format shares (devices, shapes, contiguity, the index) and the fields that do not
// depend on the format; the callers check dtypes before and their row-width rule after.
inline MlaParams parse_rows(const char* op, const TensorView& kv_buffer, const TensorView& loc,
                            const TensorView& k_nope, const TensorView& k_rope, int64_t skip_slot, RowWidths& w) {
  const DLDevice dev = kv_buffer.device();
  check_device(op, "cache_k_nope", k_nope, dev, "kv_buffer");
  check_device(op, "cache_k_rope", k_rope, dev, "kv_buffer");
  check_device(op, "loc", loc, dev, "kv_buffer");
  w.buffer = row_width(op, "kv_buffer", kv_buffer, "[num_slots, W] or [num_slots, 1, W]");
  w.nope = row_width(op, "cache_k_nope", k_nope, "[n, nope] or [n, 1, nope]");
  w.rope = row_width(op, "cache_k_rope", k_rope, "[n, rope] or [n, 1, rope]");
  check_last_dim_contiguous(op, "kv_buffer", kv_buffer);
  check_written(op, "kv_buffer", kv_buffer);
  check_last_dim_contiguous(op, "cache_k_nope", k_nope);
  check_last_dim_contiguous(op, "cache_k_rope", k_rope);
  const bool loc_i64 = check_index(op, "loc", loc);
  const int64_t n = loc.numel();
  check_rows_at_least(op, "cache_k_nope", k_nope, n, "loc");
  check_rows_at_least(op, "cache_k_rope", k_rope, n, "loc");

  const int64_t es = elem_bytes(k_nope.dtype());
  MlaParams p;
  p.dst = data_ptr(kv_buffer);
  p.nope = data_ptr(k_nope);
  p.rope = data_ptr(k_rope);
  p.loc = data_ptr(loc);
  p.n = n;
  p.num_slots = kv_buffer.size(0);
  p.dst_row_stride = kv_buffer.stride(0) * elem_bytes(kv_buffer.dtype());
  p.nope_row_stride = k_nope.stride(0) * es;
  p.rope_row_stride = k_rope.stride(0) * es;
  p.skip_slot = skip_slot;
  p.scale_ptr = nullptr;
  p.scale = 1.0f;
  p.kv_format = KvFormat::kCopy;
  p.nope_bytes = w.nope * es;
  p.rope_bytes = w.rope * es;
  p.device = dev;
  p.dtype = k_nope.dtype();
  p.loc_i64 = loc_i64;
  return p;
}

// The row-width rule of the copy and per-tensor fp8 formats: a row holds nope + rope values, or (rope_apart:
// the rope part written into rows of its own, which their caller checks) nope.
inline void check_row_width(const char* op, const RowWidths& w, bool rope_apart) {
  if (rope_apart && w.buffer < w.nope) {
    TVM_FFI_THROW(ValueError) << op << ": kv_buffer: row width " << w.buffer << " is smaller than nope = " << w.nope;
  }
  if (!rope_apart && w.buffer < w.nope + w.rope) {
    TVM_FFI_THROW(ValueError) << op << ": kv_buffer: row width " << w.buffer
                              << " is smaller than nope + rope = " << w.nope << " + " << w.rope;
  }
}

inline MlaParams parse_params(const char* op, const TensorView& kv_buffer, const TensorView& loc,
                              const TensorView& k_nope, const TensorView& k_rope, int64_t skip_slot,
                              bool rope_apart = false) {
  const DLDataType dt = kv_buffer.dtype();
  if (!is_copy_dtype(dt)) {
    TVM_FFI_THROW(TypeError) << op << ": kv_buffer: expected dtype bfloat16, float16, float32, uint8, "
                             << "float8_e4m3fn or float8_e5m2, got " << dt;
  }
  check_same_dtype(op, "cache_k_nope", k_nope, dt, "kv_buffer");
  check_same_dtype(op, "cache_k_rope", k_rope, dt, "kv_buffer");
  RowWidths w;
  const MlaParams p = parse_rows(op, kv_buffer, loc, k_nope, k_rope, skip_slot, w);
  check_row_width(op, w, rope_apart);
  return p;
}

inline const char* format_name(KvFormat f) {
  return f == KvFormat::kE4M3 ? "fp8_e4m3" : f == KvFormat::kE5M2 ? "fp8_e5m2" : "fp8_ds_mla";
}

// The Python wrapper passes kv_cache_dtype as its code (a String argument costs tvm-ffi build time).
inline KvFormat parse_fp8_format(const char* op, int64_t code) {
  if (code < static_cast<int64_t>(KvFormat::kE4M3) || code > static_cast<int64_t>(KvFormat::kDsMla)) {
    TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: expected code 1 (\"fp8_e4m3\"), 2 (\"fp8_e5m2\") or 3 "
                              << "(\"fp8_ds_mla\"), got " << code;
  }
  return static_cast<KvFormat>(code);
}

inline bool is_fp8_source(DLDataType d) {
  return d.lanes == 1 && d.bits == 16 && (d.code == kDLBfloat || d.code == kDLFloat);
}

// uint8, or the float8 dtype of a per-tensor format.
inline void check_fp8_buffer(const char* op, const TensorView& kv_buffer, KvFormat f) {
  const DLDataType d = kv_buffer.dtype();
  if (d.lanes == 1 && d.bits == 8 &&
      (d.code == kDLUInt || (f == KvFormat::kE4M3 && d.code == kDLFloat8_e4m3fn) ||
       (f == KvFormat::kE5M2 && d.code == kDLFloat8_e5m2))) {
    return;
  }
  const char* fp8 = f == KvFormat::kE4M3 ? " or float8_e4m3fn" : f == KvFormat::kE5M2 ? " or float8_e5m2" : "";
  TVM_FFI_THROW(ValueError) << op << ": kv_buffer: kv_cache_dtype=\"" << format_name(f) << "\" writes a uint8" << fp8
                            << " buffer, got " << d;
}

// The per-tensor formats' scale: a 1-element float32 tensor on the buffer's device (read by the kernel,
// so a CUDA graph replays with its new value), or a Python float (value; codes::kMissingScale exactly
// means "not given"), finite and > 0 as float32. fp8_ds_mla takes none: it computes one scale per tile.
inline void parse_fp8_scale(const char* op, KvFormat f, const Optional<TensorView>& scale, double value, MlaParams& p) {
  if (f == KvFormat::kDsMla) {
    if (scale.has_value() || value != codes::kMissingScale) {
      TVM_FFI_THROW(ValueError) << op << ": scale: kv_cache_dtype=\"fp8_ds_mla\" computes one scale per "
                                << DsMla::kTile << "-value tile; expected None";
    }
    return;
  }
  if (scale.has_value()) {
    const TensorView& s = scale.value();
    check_device(op, "scale", s, p.device, "kv_buffer");
    if (!(s.dtype().code == kDLFloat && s.dtype().bits == 32 && s.dtype().lanes == 1)) {
      TVM_FFI_THROW(TypeError) << op << ": scale: expected a float32 tensor, got " << s.dtype();
    }
    if (s.numel() != 1) {
      TVM_FFI_THROW(ValueError) << op << ": scale: expected a 1-element tensor, got shape " << shape_str(s);
    }
    check_host_scale(op, "scale", s);
    p.scale_ptr = reinterpret_cast<const float*>(data_ptr(s));
    return;
  }
  if (value == codes::kMissingScale) {
    TVM_FFI_THROW(ValueError) << op << ": scale: kv_cache_dtype=\"" << format_name(f) << "\" requires a scale "
                              << "(a float or a 1-element float32 tensor, finite and > 0), got None";
  }
  const float v = static_cast<float>(value);
  if (!scale_ok(v)) {
    TVM_FFI_THROW(ValueError) << op << ": scale: must be finite and > 0 (as float32), got " << value;
  }
  p.scale = v;
}

// The fp8 formats: k_nope and k_rope bf16 or fp16 (one dtype); kv_buffer uint8 (or the format's float8
// dtype); e4m3/e5m2: W >= nope + rope and a scale; fp8_ds_mla: nope and rope of the record, W >= its
// bytes, no scale.
inline MlaParams parse_fp8_params(const char* op, const TensorView& kv_buffer, const TensorView& loc,
                                  const TensorView& k_nope, const TensorView& k_rope, int64_t skip_slot,
                                  int64_t kv_format, const Optional<TensorView>& scale, double scale_value,
                                  bool rope_apart = false) {
  const KvFormat f = parse_fp8_format(op, kv_format);
  if (!is_fp8_source(k_nope.dtype())) {
    TVM_FFI_THROW(TypeError) << op << ": cache_k_nope: fp8 quantize-on-write takes bfloat16 or float16 sources, got "
                             << k_nope.dtype();
  }
  check_same_dtype(op, "cache_k_rope", k_rope, k_nope.dtype(), "cache_k_nope");
  check_fp8_buffer(op, kv_buffer, f);
  RowWidths w;
  MlaParams p = parse_rows(op, kv_buffer, loc, k_nope, k_rope, skip_slot, w);
  if (f == KvFormat::kDsMla) {
    if (rope_apart) TVM_FFI_THROW(ValueError) << op << ": kv_buffer: fp8_ds_mla records hold their rope part";
    if (w.nope != DsMla::kNope) {
      TVM_FFI_THROW(ValueError) << op << ": cache_k_nope: fp8_ds_mla takes rows of " << DsMla::kNope << " values, got "
                                << w.nope;
    }
    if (w.rope != DsMla::kRope) {
      TVM_FFI_THROW(ValueError) << op << ": cache_k_rope: fp8_ds_mla takes rows of " << DsMla::kRope << " values, got "
                                << w.rope;
    }
    if (w.buffer < DsMla::kBytes) {
      TVM_FFI_THROW(ValueError) << op << ": kv_buffer: row width " << w.buffer << " is smaller than the "
                                << DsMla::kBytes << "-byte fp8_ds_mla record";
    }
  } else {
    check_row_width(op, w, rope_apart);
  }
  parse_fp8_scale(op, f, scale, scale_value, p);
  p.kv_format = f;
  return p;
}

}  // namespace jitkv::mla
