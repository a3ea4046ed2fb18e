// store_cache on CPU: K and V row scatter into flat / paged NHD / paged HND caches, plain copy
// ("auto") or fp8 quantize-on-write.
//
// Algorithm: parse + validate (store_cache.cuh, its host part); resolve every slot serially (skip rules,
// loc_map, IndexError before any write); then one pass over the kept rows writes K and V of each row. A
// row is one segment when both source and destination heads are dense (the common case, including
// fused-qkv source views), else one segment per head. Copies use AVX-512 (row_copy.h); fp8
// quantizes in registers (fp8.h). OpenMP above a payload threshold, non-temporal stores when the
// written lines are cold (scatter.h want_streaming).
#include <tvm/ffi/function.h>

#include <vector>

#include "jitkv/cpu/fp8.h"
#include "jitkv/cpu/isa.h"
#include "jitkv/cpu/row_copy.h"
#include "jitkv/cpu/scatter.h"
#include "store_cache/parse.h"
#include "store_cache/side_cpu.h"

namespace jitkv {
namespace {

using codes::KvFormat;
using store_cache::Side;
using store_cache::StoreCacheParams;

constexpr const char* kOp = "store_cache";

// One side as this kernel writes it: a row is one segment when source and cache heads are dense (and
// share one scale), else one segment per head.
struct SideRows {
  const Side* side;
  int64_t segs, seg_elems, src_seg_bytes;  // segments per row, elements and source bytes per segment
  float scale;                             // fp8, one scale for the side (segment h: scale_of(h))
  const cpu::Fp8Quantizer* fp8;            // fp8: segment h's is fp8[h] with per-head scales, else fp8[0]

  // Per-head scales (Side::scale_stride != 0; host tensors, values checked by the Python wrapper).
  float scale_of(int64_t h) const { return side->scale_stride != 0 ? side->scale_ptr[h * side->scale_stride] : scale; }
};

SideRows side_rows(const Side& s, int64_t heads, int64_t head_dim, int64_t src_es, int64_t dst_es) {
  const bool dense = s.scale_stride == 0 &&
                     (heads == 1 || (s.src_stride_head == head_dim * src_es && s.dst_stride_head == head_dim * dst_es));
  SideRows r;
  r.side = &s;
  r.segs = dense ? 1 : heads;
  r.seg_elems = dense ? heads * head_dim : head_dim;
  r.src_seg_bytes = r.seg_elems * src_es;
  r.scale = 1.0f;
  r.fp8 = nullptr;
  return r;
}

inline void copy_side(const SideRows& r, int64_t row, int64_t slot, bool nt) {
  const Side& s = *r.side;
  const char* src = s.src + row * s.src_stride_token;
  char* dst = store_cache::slot_row(s, slot);
  for (int64_t h = 0; h < r.segs; ++h) {
    cpu::copy_seg(dst + h * s.dst_stride_head, src + h * s.src_stride_head, r.src_seg_bytes, nt);
  }
}

// One quantizer per segment's scale (cpu::Fp8Quantizer: its setup is shared by every row): one for the
// side, or one per head with per-head scales; m rows.
std::vector<cpu::Fp8Quantizer> quantizers(const SideRows& r, const cpu::Fp8Format& fmt, cpu::SrcKind kind, int64_t m) {
  std::vector<cpu::Fp8Quantizer> q;
  const int64_t count = r.side->scale_stride != 0 ? r.segs : 1;
  const int64_t values = m * r.segs * r.seg_elems / count;  // each one's
  q.reserve(static_cast<size_t>(count));
  for (int64_t h = 0; h < count; ++h) q.emplace_back(fmt, r.scale_of(h), kind, values);
  return q;
}

inline void quantize_side(const SideRows& r, int64_t row, int64_t slot, cpu::SrcKind kind, bool nt) {
  const Side& s = *r.side;
  const char* src = s.src + row * s.src_stride_token;
  char* dst = store_cache::slot_row(s, slot);
  cpu::Fp8Quantizer::segments(r.fp8, s.scale_stride != 0 ? 1 : 0, reinterpret_cast<uint8_t*>(dst), s.dst_stride_head,
                              kind, src, s.src_stride_head, r.segs, r.seg_elems, nt);
}

// fp8 conversion costs more per source byte than a copy: weigh its payload so threads start earlier.
constexpr int64_t kQuantizeWeight = 4;

// Writes K and V of every kept row; write(side, row, slot) handles one side of one row.
template <class Write>
void write_rows(const SideRows& k, const SideRows& v, const cpu::RowSlot* rows, int64_t m, int threads, bool nt,
                Write write) {
  cpu::for_rows(m, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      write(k, rows[i].row, rows[i].slot);
      write(v, rows[i].row, rows[i].slot);
    }
    if (nt) cpu::stream_fence();
  });
}

void write_all(const StoreCacheParams& p, const SideRows& k, const SideRows& v, const cpu::RowSlot* rows, int64_t m) {
  const bool quantize = p.kv_dtype != KvFormat::kCopy;
  const int64_t src_bytes = m * (k.segs * k.src_seg_bytes + v.segs * v.src_seg_bytes);
  const int64_t dst_bytes = quantize ? m * p.num_heads * (p.k_head_dim + p.v_head_dim) : src_bytes;
  const int threads = cpu::threads_for(quantize ? kQuantizeWeight * src_bytes : src_bytes);
  const bool nt = store_cache::streamed(p.k, k.segs != 1, p.v, v.segs != 1, dst_bytes, threads);
  if (!quantize) {
    write_rows(k, v, rows, m, threads, nt,
               [nt](const SideRows& r, int64_t row, int64_t slot) { copy_side(r, row, slot, nt); });
    return;
  }
  const cpu::Fp8Format& fmt = cpu::fp8_format(p.kv_dtype);
  const cpu::SrcKind kind = cpu::src_kind(p.src_dtype);
  const std::vector<cpu::Fp8Quantizer> kq = quantizers(k, fmt, kind, m), vq = quantizers(v, fmt, kind, m);
  SideRows kw = k, vw = v;
  kw.fp8 = kq.data();
  vw.fp8 = vq.data();
  write_rows(kw, vw, rows, m, threads, nt,
             [&](const SideRows& r, int64_t row, int64_t slot) { quantize_side(r, row, slot, kind, nt); });
}

template <class IdxT>
int64_t resolve(const StoreCacheParams& p, cpu::RowSlot* out) {
  return cpu::resolve_slots(kOp, "slot_mapping", static_cast<const IdxT*>(p.slots), p.n, p.skip_slot, p.loc_map,
                            p.loc_i64, p.loc_map_size, p.k.num_slots, out);
}

int64_t store_cache_cpu(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache, TensorView slot_mapping,
                        Optional<TensorView> loc_map, int64_t skip_slot, int64_t kv_cache_dtype,
                        Optional<TensorView> k_scale, Optional<TensorView> v_scale, double k_scale_value,
                        double v_scale_value) {
  if (k_cache.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << kOp << ": k_cache: expected a CPU tensor for the CPU kernel, got device_type "
                              << k_cache.device().device_type;
  }
  const StoreCacheParams p = store_cache::parse_params(kOp, k, v, k_cache, v_cache, slot_mapping, loc_map, skip_slot,
                                                       kv_cache_dtype, k_scale, v_scale, k_scale_value, v_scale_value);
  if (p.n == 0) return store_cache::status(codes::Status::kDone);

  cpu::RowSlotBuffer buf(p.n);
  const int64_t m = p.slot_i64 ? resolve<int64_t>(p, buf.data()) : resolve<int32_t>(p, buf.data());
  if (m == 0) return store_cache::status(codes::Status::kDone);

  const int64_t src_es = elem_bytes(p.src_dtype), dst_es = elem_bytes(k_cache.dtype());
  SideRows ks = side_rows(p.k, p.num_heads, p.k_head_dim, src_es, dst_es);
  SideRows vs = side_rows(p.v, p.num_heads, p.v_head_dim, src_es, dst_es);
  if (p.kv_dtype != KvFormat::kCopy) {
    ks.scale = p.k.scale_ptr ? *p.k.scale_ptr : p.k.scale;
    vs.scale = p.v.scale_ptr ? *p.v.scale_ptr : p.v.scale;
  }
  write_all(p, ks, vs, buf.data(), m);
  return store_cache::status(codes::Status::kDone);
}

}  // namespace
}  // namespace jitkv

TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_cache, jitkv::store_cache_cpu);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_cache_copy, jitkv::store_cache::store_cache_copy<jitkv::store_cache_cpu>);
JITKV_CPU_EXPORT_INFO();
