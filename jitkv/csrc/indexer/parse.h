// The indexer K cache's argument parsers, shared by the CUDA binding (indexer_k_cache_cuda.cu) and the
// CPU binding (indexer_k_cache_cpu.cpp): every check, with errors naming the argument, and the
// parameter blocks of the call (params.h).
#pragma once

#include <cstdint>

#include "indexer/params.h"
#include "jitkv/check.h"
#include "jitkv/codes.h"

namespace jitkv::indexer {

struct CacheGeom {
  char* base;
  int64_t num_blocks, block_stride;
};

// A uint8 cache for block_size: [num_blocks, W] with block_size * 132 <= W < (block_size + 1) * 132, or a
// [num_blocks, block_size, 132] view; block stride stride(0) a multiple of 4 (the fp32 scales) and at
// least block_size * 132; a 4-byte aligned base. The same rules and messages as
// INDEXER_K_CACHE.validate (ops/indexer.py).
inline CacheGeom parse_cache(const char* op, const TensorView& c, int64_t block_size) {
  if (block_size < 1) {
    TVM_FFI_THROW(ValueError) << op << ": block_size: expected a positive int, got " << block_size;
  }
  const DLDataType dt = c.dtype();
  if (!(dt.code == kDLUInt && dt.bits == 8 && dt.lanes == 1)) {
    TVM_FFI_THROW(TypeError) << op << ": kv_cache: expected dtype uint8, got " << dt;
  }
  const int64_t used = block_size * kTokenBytes;
  if (c.ndim() == 2) {
    if (c.size(1) / kTokenBytes != block_size) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache: blocks of " << c.size(1) << " bytes hold "
                                << c.size(1) / kTokenBytes << " tokens of " << kTokenBytes
                                << " bytes, but block_size is " << block_size << " (expected [num_blocks, W] with "
                                << used << " <= W < " << used + kTokenBytes << "), got shape " << shape_str(c);
    }
  } else if (c.ndim() == 3) {
    if (c.size(1) != block_size || c.size(2) != kTokenBytes) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected [num_blocks, " << block_size << ", " << kTokenBytes
                                << "] for block_size " << block_size << ", got " << shape_str(c);
    }
    if (block_size > 1 && c.stride(1) != kTokenBytes) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected stride(1) = " << kTokenBytes
                                << " (tokens packed in a block), got " << c.stride(1);
    }
  } else {
    TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected a 2-D [num_blocks, block_stride] or 3-D [num_blocks, "
                              << "block_size, " << kTokenBytes << "] tensor, got " << shape_str(c);
  }
  check_last_dim_contiguous(op, "kv_cache", c);
  const int64_t stride = c.stride(0);
  if (c.size(0) > 1 && (stride < used || stride % kScaleBytes != 0)) {  // one block: no stride
    TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected stride(0) (the block stride in bytes) to be a multiple of "
                              << kScaleBytes << " and >= block_size * " << kTokenBytes << " = " << used << ", got "
                              << stride;
  }
  char* base = data_ptr(c);
  if (reinterpret_cast<uintptr_t>(base) % kScaleBytes != 0) {
    TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected a " << kScaleBytes << "-byte aligned data pointer";
  }
  return CacheGeom{base, c.size(0), stride};
}

inline bool is_dtype(DLDataType d, uint8_t code, int bits) { return d.code == code && d.bits == bits && d.lanes == 1; }

inline WriteParams parse_write(const char* op, const TensorView& k, const TensorView& kv_cache,
                               const TensorView& slot_mapping, int64_t block_size, int64_t scale_fmt) {
  const CacheGeom g = parse_cache(op, kv_cache, block_size);
  const DLDevice dev = kv_cache.device();
  const bool slot_i64 = check_index(op, "slot_mapping", slot_mapping);
  check_device(op, "slot_mapping", slot_mapping, dev, "kv_cache");
  check_device(op, "k", k, dev, "kv_cache");
  const DLDataType kt = k.dtype();
  if (!is_dtype(kt, kDLBfloat, 16) && !is_dtype(kt, kDLFloat, 16)) {
    TVM_FFI_THROW(TypeError) << op << ": k: expected dtype bfloat16 or float16, got " << kt;
  }
  if (k.ndim() != 2 || k.size(1) != kHeadDim) {
    TVM_FFI_THROW(ValueError) << op << ": k: expected shape [n', " << kHeadDim << "], got " << shape_str(k);
  }
  check_last_dim_contiguous(op, "k", k);
  const int64_t n = slot_mapping.numel();
  check_rows_at_least(op, "k", k, n, "slot_mapping");
  if (scale_fmt != static_cast<int64_t>(codes::ScaleFmt::kFP32) &&
      scale_fmt != static_cast<int64_t>(codes::ScaleFmt::kUE8M0)) {
    TVM_FFI_THROW(ValueError) << op << ": scale_fmt: expected code 0 (None) or 1 ('ue8m0'), got " << scale_fmt;
  }
  WriteParams p;
  p.k = data_ptr(k);
  p.cache = g.base;
  p.slots = data_ptr(slot_mapping);
  p.n = n;
  p.k_row_stride = k.stride(0) * 2;
  p.block_stride = g.block_stride;
  p.block_size = block_size;
  p.num_slots = g.num_blocks * block_size;
  p.slot_i64 = slot_i64;
  p.ue8m0 = scale_fmt == static_cast<int64_t>(codes::ScaleFmt::kUE8M0);
  p.k_f16 = kt.code == kDLFloat;
  p.device = dev;
  return p;
}

// An int32 tensor with `rank` dims on dev whose last dim is contiguous.
inline void check_int32(const char* op, const char* name, const TensorView& t, DLDevice dev, int rank,
                        const char* want_shape) {
  check_device(op, name, t, dev, "kv_cache");
  if (!is_dtype(t.dtype(), kDLInt, 32)) {
    TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected dtype int32, got " << t.dtype();
  }
  if (t.ndim() != rank) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected shape " << want_shape << ", got " << shape_str(t);
  }
  check_last_dim_contiguous(op, name, t);
}

// dst_scale: float32 [T] or [T, 1], or uint8 [T, 4] (vLLM's); returns its row stride in bytes.
inline int64_t parse_dst_scale(const char* op, const TensorView& s, DLDevice dev, int64_t num_tokens) {
  check_device(op, "dst_scale", s, dev, "kv_cache");
  const DLDataType dt = s.dtype();
  const bool f32 = is_dtype(dt, kDLFloat, 32);
  if (!f32 && !is_dtype(dt, kDLUInt, 8)) {
    TVM_FFI_THROW(TypeError) << op << ": dst_scale: expected dtype float32 or uint8, got " << dt;
  }
  const bool ok =
      s.ndim() >= 1 && s.size(0) == num_tokens &&
      (f32 ? s.ndim() == 1 || (s.ndim() == 2 && s.size(1) == 1) : s.ndim() == 2 && s.size(1) == kScaleBytes);
  if (!ok) {
    TVM_FFI_THROW(ValueError) << op << ": dst_scale: expected shape [T] or [T, 1] (float32) or [T, " << kScaleBytes
                              << "] (uint8) with T = dst_k.shape[0] = " << num_tokens << ", got " << shape_str(s);
  }
  check_last_dim_contiguous(op, "dst_scale", s);
  check_written(op, "dst_scale", s);
  return s.stride(0) * elem_bytes(dt);
}

inline GatherParams parse_gather(const char* op, const TensorView& kv_cache, const TensorView& dst_k,
                                 const TensorView& dst_scale, const TensorView& block_table,
                                 const TensorView& cu_seq_lens, int64_t block_size) {
  const CacheGeom g = parse_cache(op, kv_cache, block_size);
  const DLDevice dev = kv_cache.device();
  check_device(op, "dst_k", dst_k, dev, "kv_cache");
  const DLDataType kt = dst_k.dtype();
  if (!is_dtype(kt, kDLUInt, 8) && !is_dtype(kt, kDLFloat8_e4m3fn, 8)) {
    TVM_FFI_THROW(TypeError) << op << ": dst_k: expected dtype uint8 or float8_e4m3fn, got " << kt;
  }
  if (dst_k.ndim() != 2 || dst_k.size(1) != kHeadDim) {
    TVM_FFI_THROW(ValueError) << op << ": dst_k: expected shape [num_tokens, " << kHeadDim << "], got "
                              << shape_str(dst_k);
  }
  check_last_dim_contiguous(op, "dst_k", dst_k);
  check_written(op, "dst_k", dst_k);
  const int64_t num_tokens = dst_k.size(0);
  const int64_t scale_stride = parse_dst_scale(op, dst_scale, dev, num_tokens);
  check_int32(op, "block_table", block_table, dev, 2, "[batch, max_blocks]");
  check_int32(op, "cu_seq_lens", cu_seq_lens, dev, 1, "[batch + 1]");
  if (cu_seq_lens.size(0) != block_table.size(0) + 1) {
    TVM_FFI_THROW(ValueError) << op << ": cu_seq_lens: expected " << block_table.size(0) + 1
                              << " entries (block_table.shape[0] + 1), got " << cu_seq_lens.size(0);
  }
  GatherParams p;
  p.cache = g.base;
  p.dst_k = data_ptr(dst_k);
  p.dst_scale = data_ptr(dst_scale);
  p.block_table = reinterpret_cast<const int32_t*>(data_ptr(block_table));
  p.cu_seq_lens = reinterpret_cast<const int32_t*>(data_ptr(cu_seq_lens));
  p.num_tokens = num_tokens;
  p.batch = block_table.size(0);
  p.max_blocks = block_table.size(1);
  p.bt_row_stride = block_table.stride(0);
  p.block_stride = g.block_stride;
  p.block_size = block_size;
  p.num_blocks = g.num_blocks;
  p.dst_k_stride = dst_k.stride(0);
  p.dst_scale_stride = scale_stride;
  p.device = dev;
  return p;
}

}  // namespace jitkv::indexer
