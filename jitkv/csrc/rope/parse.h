// rope: the attention prologue in one op (docs/design.md §9): RoPE on q and k (after a per-head
// RMSNorm when norm weights are given), the queries stored in place or quantized into q_out, and the
// rotated K with V (rope_store_cache), or the MLA row [kv_c | rope(k_pe)] (rope_set_mla_kv_buffer),
// written as store_cache / set_mla_kv_buffer write them.
//
// The argument parser, shared by the CPU binding (rope_cpu.cpp) and the CUDA bindings
// (rope_store_cache_cuda.cu, rope_set_mla_kv_buffer_cuda.cu; the parameter blocks: params.h). The
// runners (jitkv/ops/rope.py) hand over q, q_out, k, k_out and v as [n', H, D] views, q_pe, q_nope and
// q_out as [n', H, width], the caches and the MLA rows as the caller gave them; this parser checks what
// the kernels' memory accesses rely on (ranks, sizes, dtypes, devices, contiguous last dims, written
// tensors without stride 0, destinations that share no memory), reusing the store_cache and
// set_mla_kv_buffer parsers for the cache writes; all strides are kept in bytes. A refusal raises, and
// the op then runs its Python check, which names the argument as every backend does.
//
// Queries (codes::RopeQ): NONE (MLA without q_pe), IN_PLACE (q rotated in place), COPY (q_out in q's
// dtype), E4M3 / E5M2 (q_out quantized by q_scale: a 1-element float32 tensor, or q_scale_value when
// the tensor is None, codes::kMissingScale meaning "not given").
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include "jitkv/check.h"
#include "jitkv/codes.h"
#include "mla/parse.h"
#include "rope/params.h"
#include "store_cache/parse.h"

namespace jitkv::rope {

struct StoreParams {
  store_cache::StoreCacheParams kv;  // K (rotated), V and the caches
  Rotation rot;
  Queries q;
  Rows k_out;  // ptr nullptr: none
  const void* q_norm;
  const void* k_norm;          // nullptr: no norm
  codes::SrcDtype norm_dtype;  // of both weights
  float eps;
};

struct MlaParams {
  mla::MlaParams kv;  // kv_c, k_pe (unrotated) and the buffer
  Rotation rot;
  Queries q;       // q_pe: src; q_out's rope part: dst
  Rows q_nope;     // COPY / fp8 modes: the source of q_out's first nope_q values
  int64_t nope_q;  // their count
  Rows k_pe_out;   // ptr nullptr: none
};

inline bool is_float_dtype(DLDataType d) {
  return d.lanes == 1 &&
         ((d.code == kDLFloat && (d.bits == 16 || d.bits == 32)) || (d.code == kDLBfloat && d.bits == 16));
}

inline bool is_f32(DLDataType d) { return d.code == kDLFloat && d.bits == 32 && d.lanes == 1; }

// A float dtype (is_float_dtype) as its code.
inline codes::SrcDtype src_dtype(DLDataType d) {
  return d.code == kDLBfloat ? codes::SrcDtype::kBF16 : d.bits == 16 ? codes::SrcDtype::kF16 : codes::SrcDtype::kF32;
}

inline void require(bool ok, const char* op, const char* name, const char* what) {
  if (!ok) TVM_FFI_THROW(ValueError) << op << ": " << name << ": " << what;
}

inline void check_dtype(const char* op, const char* name, const TensorView& t, DLDataType dt) {
  if (t.dtype() != dt) {
    TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected dtype " << dt << ", got " << t.dtype();
  }
}

// A [n', heads, width] tensor of dtype dt on dev with at least n rows and a contiguous last dim.
inline Rows rows3(const char* op, const char* name, const TensorView& t, int64_t heads, int64_t width, int64_t n,
                  DLDataType dt, DLDevice dev, const char* dev_from) {
  check_device(op, name, t, dev, dev_from);
  require(t.ndim() == 3 && t.size(1) == heads && t.size(2) == width && t.size(0) >= n, op, name,
          "expected [tokens >= n, heads, width] as the checks normalized it");
  check_last_dim_contiguous(op, name, t);
  check_dtype(op, name, t, dt);
  const int64_t es = elem_bytes(dt);
  return Rows{data_ptr(t), t.stride(0) * es, t.stride(1) * es};
}

// A [n', width] or [n', 1, width] tensor as one-head rows.
inline Rows rows2(const char* op, const char* name, const TensorView& t, int64_t width, int64_t n, DLDataType dt,
                  DLDevice dev, const char* dev_from) {
  check_device(op, name, t, dev, dev_from);
  require((t.ndim() == 2 || (t.ndim() == 3 && t.size(1) == 1)) && t.size(t.ndim() - 1) == width && t.size(0) >= n, op,
          name, "expected [tokens >= n, width]");
  check_last_dim_contiguous(op, name, t);
  check_dtype(op, name, t, dt);
  return Rows{data_ptr(t), t.stride(0) * elem_bytes(dt), 0};
}

inline Rotation parse_rotation(const char* op, const TensorView& positions, const TensorView& cos_sin_cache,
                               int64_t rot, bool neox, int64_t n, int64_t width, DLDataType src, DLDevice dev,
                               const char* dev_from) {
  check_device(op, "positions", positions, dev, dev_from);
  check_device(op, "cos_sin_cache", cos_sin_cache, dev, dev_from);
  Rotation r;
  r.pos_i64 = check_index(op, "positions", positions);
  require(positions.numel() >= n, op, "positions", "expected one entry per token");
  require(rot > 0 && rot % 2 == 0 && rot <= width, op, "rotary_dim", "expected an even number <= head_dim");
  require(cos_sin_cache.ndim() == 2 && cos_sin_cache.size(1) == rot, op, "cos_sin_cache",
          "expected shape [max_pos, rotary_dim]");
  check_last_dim_contiguous(op, "cos_sin_cache", cos_sin_cache);
  if (!is_f32(cos_sin_cache.dtype()) && cos_sin_cache.dtype() != src) {
    TVM_FFI_THROW(TypeError) << op << ": cos_sin_cache: expected dtype float32 or " << src << ", got "
                             << cos_sin_cache.dtype();
  }
  r.positions = data_ptr(positions);
  r.max_pos = cos_sin_cache.size(0);
  r.cos_sin = data_ptr(cos_sin_cache);
  r.cs_stride = cos_sin_cache.stride(0) * elem_bytes(cos_sin_cache.dtype());
  r.cs_dtype = src_dtype(cos_sin_cache.dtype());
  r.rot = rot;
  r.neox = neox;
  return r;
}

inline RopeQ parse_q_mode(const char* op, int64_t code) {
  if (code < static_cast<int64_t>(RopeQ::kNone) || code > static_cast<int64_t>(RopeQ::kE5M2)) {
    TVM_FFI_THROW(ValueError) << op << ": q_out: unknown query mode " << code;
  }
  return static_cast<RopeQ>(code);
}

inline bool q_is_fp8(RopeQ m) { return m == RopeQ::kE4M3 || m == RopeQ::kE5M2; }

// The dtype q's destination has in mode m (src: the queries' dtype).
inline DLDataType q_dst_dtype(RopeQ m, DLDataType src) {
  if (m == RopeQ::kE4M3) return DLDataType{kDLFloat8_e4m3fn, 8, 1};
  if (m == RopeQ::kE5M2) return DLDataType{kDLFloat8_e5m2, 8, 1};
  return src;
}

inline void parse_q_scale(const char* op, RopeQ m, const Optional<TensorView>& scale, double value, DLDevice dev,
                          const char* dev_from, Queries& q) {
  q.scale_ptr = nullptr;
  q.scale = 1.0f;
  if (!q_is_fp8(m)) {
    require(!scale.has_value() && value == codes::kMissingScale, op, "q_scale", "only an fp8 q_out takes a scale");
    return;
  }
  if (scale.has_value()) {
    const TensorView& s = scale.value();
    check_device(op, "q_scale", s, dev, dev_from);
    require(is_f32(s.dtype()) && s.numel() == 1, op, "q_scale", "expected a 1-element float32 tensor");
    check_host_scale(op, "q_scale", s);
    q.scale_ptr = reinterpret_cast<const float*>(data_ptr(s));
    return;
  }
  const float f = static_cast<float>(value);
  require(value != codes::kMissingScale && scale_ok(f), op, "q_scale", "an fp8 q_out needs a scale, finite and > 0");
  q.scale = f;
}

inline StoreParams parse_store(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& k_cache, const TensorView& v_cache, const TensorView& slot_mapping,
                               const TensorView& positions, const TensorView& cos_sin_cache, bool is_neox,
                               int64_t rotary_dim, const Optional<TensorView>& q_norm_weight,
                               const Optional<TensorView>& k_norm_weight, double eps, const TensorView& q_dst,
                               int64_t q_mode, const Optional<TensorView>& q_scale, double q_scale_value,
                               const Optional<TensorView>& k_out, const Optional<TensorView>& loc_map,
                               int64_t skip_slot, int64_t kv_format, const Optional<TensorView>& k_scale,
                               const Optional<TensorView>& v_scale, double k_scale_value, double v_scale_value) {
  StoreParams p;
  p.kv = store_cache::parse_params(op, k, v, k_cache, v_cache, slot_mapping, loc_map, skip_slot, kv_format, k_scale,
                                   v_scale, k_scale_value, v_scale_value);
  const DLDataType src = p.kv.src_dtype;
  const DLDevice dev = p.kv.device;
  const int64_t n = p.kv.n, d = p.kv.k_head_dim;
  if (!is_float_dtype(src)) TVM_FFI_THROW(TypeError) << op << ": k: expected a float dtype, got " << src;
  require(k.ndim() == 3, op, "k", "expected [tokens, heads, head_dim] as the checks normalized it");
  p.rot = parse_rotation(op, positions, cos_sin_cache, rotary_dim, is_neox, n, d, src, dev, "k_cache");
  p.q.mode = parse_q_mode(op, q_mode);
  require(p.q.mode != RopeQ::kNone, op, "q_out", "rope_store_cache always has queries");
  require(q.ndim() == 3, op, "q", "expected [tokens, heads, head_dim]");
  p.q.heads = q.size(1);
  p.q.src = rows3(op, "q", q, p.q.heads, d, n, src, dev, "k_cache");
  p.q.dst = rows3(op, "q_out", q_dst, p.q.heads, d, n, q_dst_dtype(p.q.mode, src), dev, "k_cache");
  check_written(op, p.q.mode == RopeQ::kInPlace ? "q" : "q_out", q_dst);
  parse_q_scale(op, p.q.mode, q_scale, q_scale_value, dev, "k_cache", p.q);
  p.k_out = k_out.has_value() ? rows3(op, "k_out", k_out.value(), p.kv.num_heads, d, n, src, dev, "k_cache")
                              : Rows{nullptr, 0, 0};
  if (k_out.has_value()) check_written(op, "k_out", k_out.value());
  p.q_norm = p.k_norm = nullptr;
  p.norm_dtype = src_dtype(src);
  DLDataType norm_dtype = src;
  for (const auto& [name, w, out] : {std::tuple{"q_norm_weight", &q_norm_weight, &p.q_norm},
                                     std::tuple{"k_norm_weight", &k_norm_weight, &p.k_norm}}) {
    if (!w->has_value()) continue;
    const TensorView& t = w->value();
    check_device(op, name, t, dev, "k_cache");
    require(t.ndim() == 1 && t.size(0) == d && d % 8 == 0 && (t.size(0) < 2 || t.stride(0) == 1), op, name,
            "expected a contiguous [head_dim] weight, head_dim a multiple of 8");
    require(is_f32(t.dtype()) || t.dtype() == src, op, name, "expected dtype float32 or the queries'");
    require(*out == nullptr || norm_dtype == t.dtype(), op, name, "expected the dtype of q_norm_weight");
    norm_dtype = t.dtype();
    p.norm_dtype = src_dtype(t.dtype());
    *out = data_ptr(t);
  }
  require(std::isfinite(eps) && eps >= 0.0, op, "eps", "expected a finite float >= 0");
  p.eps = static_cast<float>(eps);
  for (const auto& [name, t] :
       {std::pair<const char*, const TensorView*>{p.q.mode == RopeQ::kInPlace ? nullptr : "q_out", &q_dst},
        std::pair<const char*, const TensorView*>{"k_out", k_out.has_value() ? &k_out.value() : nullptr}}) {
    if (name == nullptr || t == nullptr) continue;
    check_disjoint(op, name, *t, "k_cache", k_cache);
    check_disjoint(op, name, *t, "v_cache", v_cache);
  }
  return p;
}

inline MlaParams parse_mla(const char* op, const TensorView& kv_buffer, const TensorView& loc, const TensorView& kv_c,
                           const TensorView& k_pe, const TensorView& positions, const TensorView& cos_sin_cache,
                           bool is_neox, const Optional<TensorView>& q_pe, const Optional<TensorView>& q_nope,
                           const Optional<TensorView>& q_out, int64_t q_mode, const Optional<TensorView>& q_scale,
                           double q_scale_value, const Optional<TensorView>& k_pe_out, int64_t skip_slot,
                           int64_t kv_format, const Optional<TensorView>& scale, double scale_value,
                           bool rope_apart = false) {
  MlaParams p;
  p.kv =
      kv_format == static_cast<int64_t>(codes::KvFormat::kCopy)
          ? mla::parse_params(op, kv_buffer, loc, kv_c, k_pe, skip_slot, rope_apart)
          : mla::parse_fp8_params(op, kv_buffer, loc, kv_c, k_pe, skip_slot, kv_format, scale, scale_value, rope_apart);
  const DLDataType src = p.kv.dtype;
  const DLDevice dev = p.kv.device;
  const int64_t n = p.kv.n, es = elem_bytes(src), r = p.kv.rope_bytes / es;
  if (!is_float_dtype(src)) TVM_FFI_THROW(TypeError) << op << ": kv_c: expected a float dtype, got " << src;
  p.rot = parse_rotation(op, positions, cos_sin_cache, r, is_neox, n, r, src, dev, "kv_buffer");
  p.q.mode = parse_q_mode(op, q_mode);
  p.q.heads = 0;
  p.q.src = p.q.dst = p.q_nope = p.k_pe_out = Rows{nullptr, 0, 0};
  p.nope_q = 0;
  if (p.q.mode != RopeQ::kNone) {
    require(q_pe.has_value(), op, "q_pe", "expected a tensor with queries");
    p.q.heads = q_pe.value().ndim() == 3 ? q_pe.value().size(1) : 0;
    p.q.src = rows3(op, "q_pe", q_pe.value(), p.q.heads, r, n, src, dev, "kv_buffer");
    p.q.dst = p.q.src;
  }
  require(q_nope.has_value() == q_out.has_value(), op, "q_nope", "q_out = [q_nope | rope(q_pe)] takes both or neither");
  if (p.q.mode != RopeQ::kNone && p.q.mode != RopeQ::kInPlace) {
    require(q_nope.has_value() && q_out.has_value(), op, "q_out", "expected q_out and q_nope");
    p.nope_q = q_nope.value().ndim() == 3 ? q_nope.value().size(2) : 0;
    p.q_nope = rows3(op, "q_nope", q_nope.value(), p.q.heads, p.nope_q, n, src, dev, "kv_buffer");
    const DLDataType dt = q_dst_dtype(p.q.mode, src);
    p.q.dst = rows3(op, "q_out", q_out.value(), p.q.heads, p.nope_q + r, n, dt, dev, "kv_buffer");
  }
  if (p.q.mode == RopeQ::kInPlace) check_written(op, "q_pe", q_pe.value());
  if (p.q.mode != RopeQ::kNone && p.q.mode != RopeQ::kInPlace) check_written(op, "q_out", q_out.value());
  parse_q_scale(op, p.q.mode, q_scale, q_scale_value, dev, "kv_buffer", p.q);
  if (k_pe_out.has_value()) {
    p.k_pe_out = rows2(op, "k_pe_out", k_pe_out.value(), r, n, src, dev, "kv_buffer");
    check_written(op, "k_pe_out", k_pe_out.value());
    check_disjoint(op, "k_pe_out", k_pe_out.value(), "kv_buffer", kv_buffer);
  }
  if (p.q.mode == RopeQ::kInPlace) check_disjoint(op, "q_pe", q_pe.value(), "kv_buffer", kv_buffer);
  if (p.q.mode != RopeQ::kNone && p.q.mode != RopeQ::kInPlace) {
    check_disjoint(op, "q_out", q_out.value(), "kv_buffer", kv_buffer);
  }
  return p;
}

}  // namespace jitkv::rope
