// Argument parsing for store_cache, shared by the CPU and CUDA bindings (device-agnostic).
//
// k, v: [n', H, D] or [n', H*D]. Caches: flat [S, H, D] / [S, H*D] or paged [num_blocks, block_size, H, D]
// (logical shape; an HND cache arrives as a permuted view, its strides carry the layout). Only the
// innermost dim must be contiguous; every other stride is honoured and returned in BYTES.
// Heads: H comes from whichever of the four tensors has a head dim (all must agree; none: H = 1); a
// 2-D tensor's row is split into H heads of D = row / H, contiguous inside the row. K and V may have
// different head dims but the same H.
//
// Slot addressing (CacheGeom): slot s lives at base + (s / block_size) * stride_block
// + (s % block_size) * stride_token, head h at + h * stride_head. Flat caches have block_size 1 and
// stride_block == stride_token == the row stride.
//
// kv_cache_dtype: "auto" (cache dtype == source dtype, plain copy; scales ignored), "fp8"/"fp8_e4m3"
// (e4m3fn, max 448) or "fp8_e5m2" (max 57344). fp8 caches are float8_e4m3fn / float8_e5m2 (matching the
// string) or uint8; fp8 sources are bf16 / fp16 / fp32.
//
// Scales (fp8 only). Convention with the Python wrapper:
//   * k_scale given as a tensor: 1 element, float32, same device; k_scale_ptr points at it (read by the
//     kernel, so CUDA graphs may replay with new values); k_scale_value is then ignored.
//   * k_scale given as a Python float: k_scale = None and k_scale_value = the float. It is rounded to
//     float32 and must be finite and > 0 after rounding (ValueError otherwise).
//   * k_scale not given (None): the wrapper passes k_scale = None and k_scale_value = -1.0 exactly;
//     that means "missing" (ValueError: fp8 needs a scale). No silent 1.0.
// Same for v. The quantized value is fp8(clamp(x / scale, -max, max)), division in float32.
#pragma once

#include <cmath>


#include "jitkv/check.h"

namespace jitkv {

enum class KVDtype : int { kAuto = 0, kFp8E4M3 = 1, kFp8E5M2 = 2 };

struct CacheGeom {
  char* base;
  int64_t num_slots, block_size, stride_block, stride_token, stride_head;  // strides in bytes
};

struct SrcGeom {
  const char* base;
  int64_t stride_token, stride_head;  // bytes
};

struct StoreCacheArgs {
  SrcGeom k, v;
  CacheGeom k_cache, v_cache;
  int64_t num_heads, k_head_dim, v_head_dim;  // elements per head (k and v head dims may differ)
  DLDataType src_dtype;                       // dtype of k/v
  KVDtype kv_dtype;                           // auto: cache dtype == src dtype, plain copy
  const void* slot_mapping;
  bool slot_i64;
  int64_t n;
  const void* loc_map;  // nullptr when absent
  bool loc_map_i64;
  int64_t loc_map_size;
  int64_t skip_slot;
  const float* k_scale_ptr;  // 1-element float32 tensor (on `device`), or nullptr
  const float* v_scale_ptr;
  float k_scale_value, v_scale_value;  // used when the pointer is nullptr
  DLDevice device;
};

namespace store_cache_detail {


inline bool is_fp8_source_dtype(DLDataType d) {
  return d.lanes == 1 && ((d.code == kDLFloat && (d.bits == 16 || d.bits == 32)) ||
                          (d.code == kDLBfloat && d.bits == 16));
}

// The Python wrapper maps kv_cache_dtype strings to these codes (a String argument would cost
// ~0.6 s of build time in tvm-ffi's argument unpacking).
inline KVDtype parse_kv_dtype(const char* op, int64_t code) {
  if (code >= 0 && code <= 2) return static_cast<KVDtype>(code);
  TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: expected code 0 (\"auto\"), 1 (\"fp8_e4m3\") or "
                            << "2 (\"fp8_e5m2\"), got " << code;
  return KVDtype::kAuto;
}

inline const char* kv_dtype_name(KVDtype d) {
  return d == KVDtype::kAuto ? "auto" : d == KVDtype::kFp8E4M3 ? "fp8_e4m3" : "fp8_e5m2";
}

// Cache dtype against the source dtype and kv_cache_dtype (see the header comment).
inline void check_cache_dtype(const char* op, const char* name, const TensorView& cache, DLDataType src,
                              KVDtype kv) {
  DLDataType c = cache.dtype();
  if (kv == KVDtype::kAuto) {
    if (c == src) return;
    if (is_float8(c) && !is_float8(src)) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: \"auto\" needs " << name << " of the source "
                                << "dtype " << src << ", got an fp8 " << name << " (" << c << "); pass "
                                << "kv_cache_dtype=\"fp8_e4m3\" or \"fp8_e5m2\" with a scale to quantize";
    }
    TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected dtype " << src << " (the dtype of k, "
                             << "kv_cache_dtype=\"auto\"), got " << c;
  }
  uint8_t want = kv == KVDtype::kFp8E4M3 ? kDLFloat8_e4m3fn : kDLFloat8_e5m2;
  bool is_u8 = c.code == kDLUInt && c.bits == 8 && c.lanes == 1;
  if ((c.code == want && c.lanes == 1) || is_u8) return;
  if (is_float8(c)) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": dtype " << c << " does not match kv_cache_dtype=\""
                              << kv_dtype_name(kv) << "\" (expected "
                              << (want == kDLFloat8_e4m3fn ? "float8_e4m3fn" : "float8_e5m2") << " or uint8)";
  }
  TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: \"" << kv_dtype_name(kv) << "\" needs an fp8 "
                            << name << " (" << (want == kDLFloat8_e4m3fn ? "float8_e4m3fn" : "float8_e5m2")
                            << " or uint8), got " << c;
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
                              << s.head_dim << " (from " << src_name << "), got " << c.heads << " x "
                              << c.head_dim;
  }
  if (s.row != c.row) {
    TVM_FFI_THROW(ValueError) << op << ": " << cache_name << ": expected a row of " << s.row
                              << " elements (H*D of " << src_name << "), got " << c.row << " (shape "
                              << shape_str(cache) << ")";
  }
  return s.heads ? s : c;
}

inline SrcGeom src_geom(const TensorView& t, int64_t head_bytes, int64_t es) {
  SrcGeom g;
  g.base = data_ptr(t);
  g.stride_token = t.stride(0) * es;
  g.stride_head = t.ndim() == 3 ? t.stride(1) * es : head_bytes;
  return g;
}

inline CacheGeom cache_geom(const TensorView& t, int64_t head_bytes) {
  int64_t es = elem_bytes(t.dtype());
  CacheGeom g;
  g.base = data_ptr(t);
  if (t.ndim() == 4) {
    g.num_slots = t.size(0) * t.size(1);
    g.block_size = t.size(1);
    g.stride_block = t.stride(0) * es;
    g.stride_token = t.stride(1) * es;
    g.stride_head = t.stride(2) * es;
  } else {
    g.num_slots = t.size(0);
    g.block_size = 1;
    g.stride_block = g.stride_token = t.stride(0) * es;
    g.stride_head = t.ndim() == 3 ? t.stride(1) * es : head_bytes;
  }
  return g;
}

// Scale: tensor (pointer) or Python float (value; -1.0 exactly means "not given").
inline void parse_scale(const char* op, const char* name, const Optional<TensorView>& t, double value,
                        DLDevice dev, KVDtype kv, const float** ptr, float* val) {
  *ptr = nullptr;
  *val = 1.0f;
  if (t.has_value()) {
    const TensorView& s = t.value();
    check_device(op, name, s, dev, "k_cache");
    if (!(s.dtype().code == kDLFloat && s.dtype().bits == 32 && s.dtype().lanes == 1)) {
      TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected a float32 tensor, got " << s.dtype();
    }
    if (s.numel() != 1) {
      TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a 1-element tensor, got shape "
                                << shape_str(s);
    }
    *ptr = reinterpret_cast<const float*>(data_ptr(s));
    return;
  }
  if (value == -1.0) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": kv_cache_dtype=\"" << kv_dtype_name(kv)
                              << "\" requires a scale (a Python float or a 1-element float32 tensor, "
                              << "finite and > 0), got None";
  }
  float f = static_cast<float>(value);
  if (!(std::isfinite(f) && f > 0.0f)) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": must be finite and > 0 (as float32), got " << value;
  }
  *val = f;
}

}  // namespace store_cache_detail

inline StoreCacheArgs parse_store_cache_args(const char* op, const TensorView& k, const TensorView& v,
                                             const TensorView& k_cache, const TensorView& v_cache,
                                             const TensorView& slot_mapping, const Optional<TensorView>& loc_map,
                                             int64_t skip_slot, int64_t kv_cache_dtype,
                                             const Optional<TensorView>& k_scale,
                                             const Optional<TensorView>& v_scale, double k_scale_value,
                                             double v_scale_value) {
  namespace d = store_cache_detail;
  KVDtype kv = d::parse_kv_dtype(op, kv_cache_dtype);
  DLDevice dev = k_cache.device();
  check_device(op, "k", k, dev, "k_cache");
  check_device(op, "v", v, dev, "k_cache");
  check_device(op, "v_cache", v_cache, dev, "k_cache");
  check_device(op, "slot_mapping", slot_mapping, dev, "k_cache");

  // dtypes
  DLDataType src = k.dtype();
  if (kv == KVDtype::kAuto ? !is_copy_dtype(src) : !d::is_fp8_source_dtype(src)) {
    TVM_FFI_THROW(TypeError) << op << ": k: expected dtype "
                             << (kv == KVDtype::kAuto
                                     ? "bfloat16, float16, float32, uint8, float8_e4m3fn or float8_e5m2"
                                     : "bfloat16, float16 or float32 (quantized to fp8)")
                             << " with kv_cache_dtype=\"" << d::kv_dtype_name(kv) << "\", got " << src;
  }
  check_same_dtype(op, "v", v, src, "k");
  d::check_cache_dtype(op, "k_cache", k_cache, src, kv);
  d::check_cache_dtype(op, "v_cache", v_cache, src, kv);

  // shapes
  d::check_rank(op, "k", k, false);
  d::check_rank(op, "v", v, false);
  d::check_rank(op, "k_cache", k_cache, true);
  d::check_rank(op, "v_cache", v_cache, true);
  check_last_dim_contiguous(op, "k", k);
  check_last_dim_contiguous(op, "v", v);
  check_last_dim_contiguous(op, "k_cache", k_cache);
  check_last_dim_contiguous(op, "v_cache", v_cache);
  d::HeadShape ks = d::pair_shape(op, "k", "k_cache", k, k_cache);
  d::HeadShape vs = d::pair_shape(op, "v", "v_cache", v, v_cache);
  if (ks.heads && vs.heads && ks.heads != vs.heads) {
    TVM_FFI_THROW(ValueError) << op << ": v: expected " << ks.heads << " heads (as k), got " << vs.heads;
  }
  int64_t heads = ks.heads ? ks.heads : vs.heads ? vs.heads : 1;
  if (ks.row % heads != 0) {
    TVM_FFI_THROW(ValueError) << op << ": k: row of " << ks.row << " elements does not split into the "
                              << heads << " heads of v";
  }
  if (vs.row % heads != 0) {
    TVM_FFI_THROW(ValueError) << op << ": v: row of " << vs.row << " elements does not split into the "
                              << heads << " heads of k";
  }
  int64_t k_dim = ks.row / heads, v_dim = vs.row / heads;

  bool slot_i64 = check_index(op, "slot_mapping", slot_mapping);
  int64_t n = slot_mapping.numel();
  check_rows_at_least(op, "k", k, n, "slot_mapping");
  check_rows_at_least(op, "v", v, n, "slot_mapping");

  int64_t src_es = elem_bytes(src);
  StoreCacheArgs a;
  a.k = d::src_geom(k, k_dim * src_es, src_es);
  a.v = d::src_geom(v, v_dim * src_es, src_es);
  a.k_cache = d::cache_geom(k_cache, k_dim * elem_bytes(k_cache.dtype()));
  a.v_cache = d::cache_geom(v_cache, v_dim * elem_bytes(v_cache.dtype()));
  if (a.k_cache.num_slots != a.v_cache.num_slots) {
    TVM_FFI_THROW(ValueError) << op << ": v_cache: expected " << a.k_cache.num_slots
                              << " slots (as k_cache), got " << a.v_cache.num_slots << " (shape "
                              << shape_str(v_cache) << ")";
  }
  a.num_heads = heads;
  a.k_head_dim = k_dim;
  a.v_head_dim = v_dim;
  a.src_dtype = src;
  a.kv_dtype = kv;
  a.slot_mapping = data_ptr(slot_mapping);
  a.slot_i64 = slot_i64;
  a.n = n;
  a.loc_map = nullptr;
  a.loc_map_i64 = false;
  a.loc_map_size = 0;
  if (loc_map.has_value()) {
    const TensorView& lm = loc_map.value();
    check_device(op, "loc_map", lm, dev, "k_cache");
    a.loc_map_i64 = check_index(op, "loc_map", lm);
    a.loc_map = data_ptr(lm);
    a.loc_map_size = lm.numel();
  }
  a.skip_slot = skip_slot;
  a.k_scale_ptr = a.v_scale_ptr = nullptr;
  a.k_scale_value = a.v_scale_value = 1.0f;
  if (kv != KVDtype::kAuto) {
    d::parse_scale(op, "k_scale", k_scale, k_scale_value, dev, kv, &a.k_scale_ptr, &a.k_scale_value);
    d::parse_scale(op, "v_scale", v_scale, v_scale_value, dev, kv, &a.v_scale_ptr, &a.v_scale_value);
  }
  a.device = dev;
  return a;
}

// The kv_cache_dtype "auto" entry point of a binding `kFull` (the CPU or CUDA store_cache): its first
// seven arguments, no fp8 ones. The decode path calls it eagerly; tvm-ffi converts each argument on
// every call (the benchmark's "bare tvm-ffi binding" row measures it).
using StoreCacheFn = void (*)(TensorView, TensorView, TensorView, TensorView, TensorView, Optional<TensorView>,
                              int64_t, int64_t, Optional<TensorView>, Optional<TensorView>, double, double);
template <StoreCacheFn kFull>
void store_cache_copy(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache, TensorView slot_mapping,
                      Optional<TensorView> loc_map, int64_t skip_slot) {
  kFull(k, v, k_cache, v_cache, slot_mapping, loc_map, skip_slot, static_cast<int64_t>(KVDtype::kAuto),
        Optional<TensorView>(), Optional<TensorView>(), -1.0, -1.0);
}

}  // namespace jitkv
