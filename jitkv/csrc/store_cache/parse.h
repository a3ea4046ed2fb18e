// store_cache: scatter K and V rows of n tokens into flat / paged-NHD / paged-HND caches, copying bytes
// ("auto") or quantizing bf16/fp16/fp32 to FP8 on the way (docs/design.md §2-§4).
//
// The argument parser, shared by the CUDA binding (store_cache_cuda.cu) and the CPU binding
// (store_cache_cpu.cpp): every check, with errors naming the argument, and the call's parameters
// (StoreCacheParams; the kernels get its StoreCacheArgs part, params.h).
//
// Arguments. k, v: [n', H, D] or [n', H*D], n' >= n = slot_mapping.numel(). Caches: flat [S, H, D] /
// [S, H*D] or paged [num_blocks, block_size, H, D] (logical shape; an HND cache arrives as a permuted
// view, its strides carry the layout). Only the innermost dim must be contiguous; every other stride
// is honoured and kept in BYTES. Heads: H comes from whichever of the four tensors has a head dim (all
// must agree; none: H = 1); a 2-D tensor's row is split into H heads of D = row / H, contiguous inside
// the row. K and V may have different head dims but the same H. Slot s lives at
// dst + (s / block_size) * dst_stride_block + (s % block_size) * dst_stride_token, head h at
// + h * dst_stride_head; flat caches have block_size 1 and dst_stride_block == dst_stride_token == the
// row stride.
//
// kv_cache_dtype arrives as its code (codes::KvFormat copy, e4m3 or e5m2; a String argument costs
// tvm-ffi build time): a plain copy (cache dtype == source dtype; scales ignored), e4m3fn (max 448) or
// e5m2 (max 57344). fp8 caches are float8_e4m3fn / float8_e5m2 (matching the code) or uint8; fp8
// sources are bf16 / fp16 / fp32.
//
// Scales (fp8 only). Convention with the Python wrapper:
//   * k_scale given as a tensor: float32, same device, 1 element (any shape) or [num_heads] (vLLM's
//     per-head quantization: head h of every row is divided by k_scale[h]); read by the kernel, so CUDA
//     graphs may replay with new values; k_scale_value is then ignored.
//   * k_scale given as a Python float: k_scale = None and k_scale_value = the float. It is rounded to
//     float32 and must be finite and > 0 after rounding (ValueError otherwise).
//   * k_scale not given (None): the wrapper passes k_scale = None and k_scale_value =
//     codes::kMissingScale exactly; that means "missing" (ValueError: fp8 needs a scale). No silent 1.0.
// Same for v. The quantized value is fp8(clamp(x / scale, -max, max)), division in float32.
#pragma once

#include <cmath>
#include <cstdint>

#include "jitkv/check.h"
#include "jitkv/codes.h"
#include "store_cache/params.h"

namespace jitkv::store_cache {

using codes::KvFormat;

// The call: the kernels' block and what only the host needs.
struct StoreCacheParams : StoreCacheArgs {
  int64_t num_heads, k_head_dim, v_head_dim;  // elements per head
  DLDataType src_dtype;                       // dtype of k and v
  KvFormat kv_dtype;
  DLDevice device;
};

inline bool is_fp8_source_dtype(DLDataType d) {
  return d.lanes == 1 &&
         ((d.code == kDLFloat && (d.bits == 16 || d.bits == 32)) || (d.code == kDLBfloat && d.bits == 16));
}

inline KvFormat parse_kv_dtype(const char* op, int64_t code) {
  for (KvFormat f : {KvFormat::kCopy, KvFormat::kE4M3, KvFormat::kE5M2}) {
    if (code == static_cast<int64_t>(f)) return f;
  }
  TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: expected code " << static_cast<int>(KvFormat::kCopy)
                            << " (\"auto\"), " << static_cast<int>(KvFormat::kE4M3) << " (\"fp8_e4m3\") or "
                            << static_cast<int>(KvFormat::kE5M2) << " (\"fp8_e5m2\"), got " << code;
  return KvFormat::kCopy;
}

inline const char* kv_dtype_name(KvFormat d) {
  return d == KvFormat::kCopy ? "auto" : d == KvFormat::kE4M3 ? "fp8_e4m3" : "fp8_e5m2";
}

// Cache dtype against the source dtype and kv_cache_dtype (see the top of this file).
inline void check_cache_dtype(const char* op, const char* name, const TensorView& cache, DLDataType src, KvFormat kv) {
  DLDataType c = cache.dtype();
  if (kv == KvFormat::kCopy) {
    if (c == src) return;
    if (is_float8(c) && !is_float8(src)) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: \"auto\" needs " << name << " of the source "
                                << "dtype " << src << ", got an fp8 " << name << " (" << c << "); pass "
                                << "kv_cache_dtype=\"fp8_e4m3\" or \"fp8_e5m2\" with a scale to quantize";
    }
    TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected dtype " << src << " (the dtype of k, "
                             << "kv_cache_dtype=\"auto\"), got " << c;
  }
  uint8_t want = kv == KvFormat::kE4M3 ? kDLFloat8_e4m3fn : kDLFloat8_e5m2;
  bool is_u8 = c.code == kDLUInt && c.bits == 8 && c.lanes == 1;
  if ((c.code == want && c.lanes == 1) || is_u8) return;
  if (is_float8(c)) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": dtype " << c << " does not match kv_cache_dtype=\""
                              << kv_dtype_name(kv) << "\" (expected "
                              << (want == kDLFloat8_e4m3fn ? "float8_e4m3fn" : "float8_e5m2") << " or uint8)";
  }
  TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: \"" << kv_dtype_name(kv) << "\" needs an fp8 " << name << " ("
                            << (want == kDLFloat8_e4m3fn ? "float8_e4m3fn" : "float8_e5m2") << " or uint8), got " << c;
}

// Head structure of one tensor: heads = 0 when it has no head dim (2-D).
struct HeadShape {
  int64_t heads, head_dim, row;
};

inline HeadShape head_shape(const TensorView& t) {
  int64_t last = t.size(t.ndim() - 1);
  if (t.ndim() < 3) return {0, 0, last};
  int64_t h = t.size(t.ndim() - 2);
  return {h, last, h * last};
}

inline void check_rank(const char* op, const char* name, const TensorView& t, bool is_cache) {
  int nd = t.ndim();
  bool ok = is_cache ? (nd >= 2 && nd <= 4) : (nd == 2 || nd == 3);
  if (!ok) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected shape "
                              << (is_cache ? "[num_slots, H, D], [num_slots, H*D] or "
                                             "[num_blocks, block_size, H, D]"
                                           : "[n, H, D] or [n, H*D]")
                              << ", got " << shape_str(t);
  }
}

// (heads, head_dim, row) of one source/cache pair; heads = 0 when neither tensor has a head dim.
inline HeadShape pair_shape(const char* op, const char* src_name, const char* cache_name, const TensorView& src,
                            const TensorView& cache) {
  HeadShape s = head_shape(src), c = head_shape(cache);
  if (s.heads && c.heads && (s.heads != c.heads || s.head_dim != c.head_dim)) {
    TVM_FFI_THROW(ValueError) << op << ": " << cache_name << ": expected heads x head_dim = " << s.heads << " x "
                              << s.head_dim << " (from " << src_name << "), got " << c.heads << " x " << c.head_dim;
  }
  if (s.row != c.row) {
    TVM_FFI_THROW(ValueError) << op << ": " << cache_name << ": expected a row of " << s.row << " elements (H*D of "
                              << src_name << "), got " << c.row << " (shape " << shape_str(cache) << ")";
  }
  return s.heads ? s : c;
}

// The source fields of a side: [n', H, D] or [n', H*D] (heads of head_bytes, contiguous in the row).
inline void set_source(Side& s, const TensorView& t, int64_t head_bytes, int64_t es) {
  s.src = data_ptr(t);
  s.src_stride_token = t.stride(0) * es;
  s.src_stride_head = t.ndim() == 3 ? t.stride(1) * es : head_bytes;
}

// The cache fields of a side: paged 4-D, or flat (block_size 1).
inline void set_cache(Side& s, const TensorView& t, int64_t head_bytes) {
  const int64_t es = elem_bytes(t.dtype());
  s.dst = data_ptr(t);
  if (t.ndim() == 4) {
    s.num_slots = t.size(0) * t.size(1);
    s.block_size = t.size(1);
    s.dst_stride_block = t.stride(0) * es;
    s.dst_stride_token = t.stride(1) * es;
    s.dst_stride_head = t.stride(2) * es;
  } else {
    s.num_slots = t.size(0);
    s.block_size = 1;
    s.dst_stride_block = s.dst_stride_token = t.stride(0) * es;
    s.dst_stride_head = t.ndim() == 3 ? t.stride(1) * es : head_bytes;
  }
}

// Scale: tensor (pointer; one element, or [heads] per-head scales) or Python float (value;
// codes::kMissingScale exactly means "not given").
inline void parse_scale(const char* op, const char* name, const Optional<TensorView>& t, double value, DLDevice dev,
                        KvFormat kv, int64_t heads, Side& side) {
  side.scale_ptr = nullptr;
  side.scale = 1.0f;
  side.scale_stride = 0;
  if (t.has_value()) {
    const TensorView& s = t.value();
    check_device(op, name, s, dev, "k_cache");
    if (!(s.dtype().code == kDLFloat && s.dtype().bits == 32 && s.dtype().lanes == 1)) {
      TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected a float32 tensor, got " << s.dtype();
    }
    const bool per_head = s.ndim() == 1 && s.size(0) == heads && heads > 1;
    if (s.numel() != 1 && !per_head) {
      TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a 1-element tensor or [num_heads] = [" << heads
                                << "] per-head scales, got shape " << shape_str(s);
    }
    if (per_head && (s.stride(0) < 0 || s.stride(0) > INT32_MAX)) {
      TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a stride below 2^31, got " << s.stride(0);
    }
    check_host_scale(op, name, s);
    side.scale_ptr = reinterpret_cast<const float*>(data_ptr(s));
    side.scale_stride = per_head ? static_cast<int32_t>(s.stride(0)) : 0;
    return;
  }
  if (value == codes::kMissingScale) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": kv_cache_dtype=\"" << kv_dtype_name(kv)
                              << "\" requires a scale (a Python float or a 1-element float32 tensor, "
                              << "finite and > 0), got None";
  }
  float f = static_cast<float>(value);
  if (!scale_ok(f)) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": must be finite and > 0 (as float32), got " << value;
  }
  side.scale = f;
}

// Checks every argument (device types are the bindings' business; the parser checks that all tensors
// share one device) and fills everything but the CUDA binding's fields of Side.
inline StoreCacheParams parse_params(const char* op, const TensorView& k, const TensorView& v,
                                     const TensorView& k_cache, const TensorView& v_cache,
                                     const TensorView& slot_mapping, const Optional<TensorView>& loc_map,
                                     int64_t skip_slot, int64_t kv_cache_dtype, const Optional<TensorView>& k_scale,
                                     const Optional<TensorView>& v_scale, double k_scale_value, double v_scale_value) {
  const KvFormat kv = parse_kv_dtype(op, kv_cache_dtype);
  const DLDevice dev = k_cache.device();
  check_device(op, "k", k, dev, "k_cache");
  check_device(op, "v", v, dev, "k_cache");
  check_device(op, "v_cache", v_cache, dev, "k_cache");
  check_device(op, "slot_mapping", slot_mapping, dev, "k_cache");

  // dtypes
  const DLDataType src = k.dtype();
  if (kv == KvFormat::kCopy ? !is_copy_dtype(src) : !is_fp8_source_dtype(src)) {
    TVM_FFI_THROW(TypeError) << op << ": k: expected dtype "
                             << (kv == KvFormat::kCopy
                                     ? "bfloat16, float16, float32, uint8, float8_e4m3fn or float8_e5m2"
                                     : "bfloat16, float16 or float32 (quantized to fp8)")
                             << " with kv_cache_dtype=\"" << kv_dtype_name(kv) << "\", got " << src;
  }
  check_same_dtype(op, "v", v, src, "k");
  check_cache_dtype(op, "k_cache", k_cache, src, kv);
  check_cache_dtype(op, "v_cache", v_cache, src, kv);

  // shapes
  check_rank(op, "k", k, false);
  check_rank(op, "v", v, false);
  check_rank(op, "k_cache", k_cache, true);
  check_rank(op, "v_cache", v_cache, true);
  check_last_dim_contiguous(op, "k", k);
  check_last_dim_contiguous(op, "v", v);
  check_last_dim_contiguous(op, "k_cache", k_cache);
  check_last_dim_contiguous(op, "v_cache", v_cache);
  check_written(op, "k_cache", k_cache);
  check_written(op, "v_cache", v_cache);
  check_disjoint(op, "k_cache", k_cache, "v_cache", v_cache);
  const HeadShape ks = pair_shape(op, "k", "k_cache", k, k_cache);
  const HeadShape vs = pair_shape(op, "v", "v_cache", v, v_cache);
  if (ks.heads && vs.heads && ks.heads != vs.heads) {
    TVM_FFI_THROW(ValueError) << op << ": v: expected " << ks.heads << " heads (as k), got " << vs.heads;
  }
  const int64_t heads = ks.heads ? ks.heads : vs.heads ? vs.heads : 1;
  if (ks.row % heads != 0) {
    TVM_FFI_THROW(ValueError) << op << ": k: row of " << ks.row << " elements does not split into the " << heads
                              << " heads of v";
  }
  if (vs.row % heads != 0) {
    TVM_FFI_THROW(ValueError) << op << ": v: row of " << vs.row << " elements does not split into the " << heads
                              << " heads of k";
  }
  const int64_t k_dim = ks.row / heads, v_dim = vs.row / heads;

  const bool slot_i64 = check_index(op, "slot_mapping", slot_mapping);
  const int64_t n = slot_mapping.numel();
  check_rows_at_least(op, "k", k, n, "slot_mapping");
  check_rows_at_least(op, "v", v, n, "slot_mapping");

  const int64_t src_es = elem_bytes(src);
  StoreCacheParams p{};
  set_source(p.k, k, k_dim * src_es, src_es);
  set_source(p.v, v, v_dim * src_es, src_es);
  set_cache(p.k, k_cache, k_dim * elem_bytes(k_cache.dtype()));
  set_cache(p.v, v_cache, v_dim * elem_bytes(v_cache.dtype()));
  if (p.k.num_slots != p.v.num_slots) {
    TVM_FFI_THROW(ValueError) << op << ": v_cache: expected " << p.k.num_slots << " slots (as k_cache), got "
                              << p.v.num_slots << " (shape " << shape_str(v_cache) << ")";
  }
  p.slots = data_ptr(slot_mapping);
  p.loc_map = nullptr;
  p.loc_map_size = 0;
  p.n = n;
  p.skip_slot = skip_slot;
  p.slot_i64 = slot_i64;
  p.loc_i64 = 0;
  if (loc_map.has_value()) {
    const TensorView& lm = loc_map.value();
    check_device(op, "loc_map", lm, dev, "k_cache");
    p.loc_i64 = check_index(op, "loc_map", lm);
    p.loc_map = data_ptr(lm);
    p.loc_map_size = lm.numel();
  }
  p.same_blocks = p.k.block_size == p.v.block_size;
  p.k.scale_ptr = p.v.scale_ptr = nullptr;
  p.k.scale = p.v.scale = 1.0f;
  p.k.scale_stride = p.v.scale_stride = 0;
  if (kv != KvFormat::kCopy) {
    parse_scale(op, "k_scale", k_scale, k_scale_value, dev, kv, heads, p.k);
    parse_scale(op, "v_scale", v_scale, v_scale_value, dev, kv, heads, p.v);
  }
  p.num_heads = heads;
  p.k_head_dim = k_dim;
  p.v_head_dim = v_dim;
  p.src_dtype = src;
  p.kv_dtype = kv;
  p.device = dev;
  return p;
}

// What a binding returns, a codes::Status: kDone after the write (every CPU call), or kNeedsAnyAlignment
// from a 16-byte CUDA build given a view it cannot address with 16-byte vectors, before anything runs;
// the op then dispatches the any-alignment build (ops/store_cache.py).
constexpr int64_t status(codes::Status s) { return static_cast<int64_t>(s); }

// The kv_cache_dtype "auto" entry point of a binding `kFull` (the CPU or CUDA store_cache): its first
// seven arguments, no fp8 ones. The decode path calls it eagerly; tvm-ffi converts each argument on
// every call (the benchmark's "bare tvm-ffi binding" row measures it).
using StoreCacheFn = int64_t (*)(TensorView, TensorView, TensorView, TensorView, TensorView, Optional<TensorView>,
                                 int64_t, int64_t, Optional<TensorView>, Optional<TensorView>, double, double);
template <StoreCacheFn kFull>
int64_t store_cache_copy(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache, TensorView slot_mapping,
                         Optional<TensorView> loc_map, int64_t skip_slot) {
  return kFull(k, v, k_cache, v_cache, slot_mapping, loc_map, skip_slot, static_cast<int64_t>(KvFormat::kCopy),
               Optional<TensorView>(), Optional<TensorView>(), codes::kMissingScale, codes::kMissingScale);
}

}  // namespace jitkv::store_cache
