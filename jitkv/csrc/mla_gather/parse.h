// gather_mla_cache's argument parser, shared by the CUDA binding (gather_mla_cache_cuda.cu) and the CPU
// binding (gather_mla_cache_cpu.cpp): every check, with errors naming the argument, and the parameter
// block of the call (params.h).
#pragma once

#include <cstdint>

#include "jitkv/check.h"
#include "jitkv/codes.h"
#include "mla_gather/params.h"

namespace jitkv::mla_gather {

inline const char* format_name(KvFormat f) {
  switch (f) {
    case KvFormat::kCopy:
      return "auto";
    case KvFormat::kE4M3:
      return "fp8_e4m3";
    case KvFormat::kE5M2:
      return "fp8_e5m2";
    default:
      return "fp8_ds_mla";
  }
}

namespace detail {

inline bool is_u8(DLDataType d) { return d.code == kDLUInt && d.bits == 8 && d.lanes == 1; }
inline bool is_bf16(DLDataType d) { return d.code == kDLBfloat && d.bits == 16 && d.lanes == 1; }

inline KvFormat parse_format(const char* op, int64_t code) {
  if (code >= static_cast<int64_t>(KvFormat::kCopy) && code <= static_cast<int64_t>(KvFormat::kDsMla)) {
    return static_cast<KvFormat>(code);
  }
  TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: expected code 0 (\"auto\"), 1 (\"fp8_e4m3\"), 2 "
                            << "(\"fp8_e5m2\") or 3 (\"fp8_ds_mla\"), got " << code;
  return KvFormat::kCopy;
}

// kv_cache's and out's dtypes for the format.
inline void check_dtypes(const char* op, const TensorView& out, const TensorView& cache, KvFormat f) {
  const DLDataType c = cache.dtype();
  if (f == KvFormat::kCopy) {
    if (!is_copy_dtype(c)) {
      TVM_FFI_THROW(TypeError) << op << ": kv_cache: expected dtype bfloat16, float16, float32, uint8, "
                               << "float8_e4m3fn or float8_e5m2, got " << c;
    }
    check_same_dtype(op, "out", out, c, "kv_cache (kv_cache_dtype='auto' copies)");
    return;
  }
  const bool fp8_ok =
      (f == KvFormat::kE4M3 && c.code == kDLFloat8_e4m3fn) || (f == KvFormat::kE5M2 && c.code == kDLFloat8_e5m2);
  if (!is_u8(c) && !fp8_ok) {
    const char* need = f == KvFormat::kDsMla  ? "a uint8"
                       : f == KvFormat::kE4M3 ? "a float8_e4m3fn or uint8"
                                              : "a float8_e5m2 or uint8";
    TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: '" << format_name(f) << "' needs " << need
                              << " kv_cache, got " << c;
  }
  if (!is_bf16(out.dtype())) {
    TVM_FFI_THROW(TypeError) << op << ": out: expected dtype bfloat16 (kv_cache_dtype='" << format_name(f)
                             << "' dequantizes to bf16), got " << out.dtype();
  }
}

// out's row width D against the cache entry width W.
inline void check_widths(const char* op, int64_t d, int64_t w, KvFormat f) {
  int64_t want = w;
  if (f == KvFormat::kDsMla) {
    if (w != DsMla::kBytes) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected entries of " << DsMla::kBytes
                                << " bytes (the fp8_ds_mla record), got " << w;
    }
    want = kDsMlaOutDims;
  }
  if (d != want) {
    TVM_FFI_THROW(ValueError) << op << ": out: expected rows of " << want << " elements (kv_cache's entries), got "
                              << d;
  }
}

inline void check_rows_for_reqs(const char* op, const char* name, const TensorView& t, int64_t num_reqs) {
  if (t.size(0) < num_reqs) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected at least " << num_reqs
                              << " rows (cu_seq_lens.numel() - 1), got " << t.size(0);
  }
}

// The per-tensor fp8 scale: a tensor (read on the device) or a value (codes::kMissingScale exactly: not
// given).
inline void parse_scale(const char* op, const Optional<TensorView>& t, double value, DLDevice dev, KvFormat f,
                        GatherParams& p) {
  p.scale_ptr = nullptr;
  p.scale_value = 1.0f;
  if (f != KvFormat::kE4M3 && f != KvFormat::kE5M2) return;
  if (t.has_value()) {
    const TensorView& s = t.value();
    check_device(op, "scale", s, dev, "out");
    if (!(s.dtype().code == kDLFloat && s.dtype().bits == 32 && s.dtype().lanes == 1)) {
      TVM_FFI_THROW(TypeError) << op << ": scale: expected a float32 tensor, got " << s.dtype();
    }
    if (s.numel() != 1) {
      TVM_FFI_THROW(ValueError) << op << ": scale: expected a 1-element tensor, got " << s.numel() << " elements";
    }
    check_host_scale(op, "scale", s);
    p.scale_ptr = reinterpret_cast<const float*>(data_ptr(s));
    return;
  }
  if (value == codes::kMissingScale) {
    TVM_FFI_THROW(ValueError) << op << ": scale: required for an fp8 kv_cache_dtype (no default scale)";
  }
  const float v = static_cast<float>(value);
  if (!scale_ok(v)) {
    TVM_FFI_THROW(ValueError) << op << ": scale: must be finite and > 0, got " << value;
  }
  p.scale_value = v;
}

}  // namespace detail

inline GatherParams parse_params(const char* op, const TensorView& out, const TensorView& kv_cache,
                                 const TensorView& block_table, const TensorView& cu_seq_lens,
                                 const Optional<TensorView>& seq_starts, int64_t format,
                                 const Optional<TensorView>& scale, double scale_value) {
  namespace d = detail;
  const KvFormat f = d::parse_format(op, format);
  const DLDevice dev = out.device();
  check_device(op, "kv_cache", kv_cache, dev, "out");
  const bool cu_i64 = check_index(op, "cu_seq_lens", cu_seq_lens);
  check_device(op, "cu_seq_lens", cu_seq_lens, dev, "out");
  bool starts_i64 = false;
  if (seq_starts.has_value()) {
    starts_i64 = check_index(op, "seq_starts", seq_starts.value());
    check_device(op, "seq_starts", seq_starts.value(), dev, "out");
  }
  check_device(op, "block_table", block_table, dev, "out");
  d::check_dtypes(op, out, kv_cache, f);
  if (kv_cache.ndim() != 3) {
    TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected shape [num_blocks, block_size, W], got "
                              << shape_str(kv_cache);
  }
  check_last_dim_contiguous(op, "kv_cache", kv_cache);
  if (out.ndim() != 2) {
    TVM_FFI_THROW(ValueError) << op << ": out: expected shape [total_tokens, D], got " << shape_str(out);
  }
  check_last_dim_contiguous(op, "out", out);
  check_written(op, "out", out);
  d::check_widths(op, out.size(1), kv_cache.size(2), f);
  const int64_t num_reqs = cu_seq_lens.numel() - 1;
  if (num_reqs < 0) {
    TVM_FFI_THROW(ValueError) << op << ": cu_seq_lens: expected num_reqs + 1 >= 1 entries, got 0";
  }
  const DLDataType bt = block_table.dtype();
  if (bt.code != kDLInt || (bt.bits != 32 && bt.bits != 64) || bt.lanes != 1) {
    TVM_FFI_THROW(TypeError) << op << ": block_table: expected dtype int32 or int64, got " << bt;
  }
  if (block_table.ndim() != 2) {
    TVM_FFI_THROW(ValueError) << op << ": block_table: expected shape [num_reqs, max_blocks], got "
                              << shape_str(block_table);
  }
  check_last_dim_contiguous(op, "block_table", block_table);
  d::check_rows_for_reqs(op, "block_table", block_table, num_reqs);
  if (seq_starts.has_value()) d::check_rows_for_reqs(op, "seq_starts", seq_starts.value(), num_reqs);

  GatherParams p;
  d::parse_scale(op, scale, scale_value, dev, f, p);
  const int64_t ces = elem_bytes(kv_cache.dtype()), oes = elem_bytes(out.dtype());
  p.out = data_ptr(out);
  p.cache = data_ptr(kv_cache);
  p.block_table = data_ptr(block_table);
  p.cu_seq_lens = data_ptr(cu_seq_lens);
  p.seq_starts = seq_starts.has_value() ? data_ptr(seq_starts.value()) : nullptr;
  p.rows = out.size(0);
  p.num_reqs = num_reqs;
  p.out_row_stride = out.stride(0) * oes;
  p.num_blocks = kv_cache.size(0);
  p.block_size = kv_cache.size(1);
  p.block_stride = kv_cache.stride(0) * ces;
  p.token_stride = kv_cache.stride(1) * ces;
  p.bt_row_stride = block_table.stride(0);
  p.max_blocks = block_table.size(1);
  p.entry_bytes = kv_cache.size(2) * ces;
  p.out_row_bytes = out.size(1) * oes;
  p.format = f;
  p.bt_i64 = bt.bits == 64;
  p.cu_i64 = cu_i64;
  p.starts_i64 = starts_i64;
  p.device = dev;
  return p;
}

}  // namespace jitkv::mla_gather
