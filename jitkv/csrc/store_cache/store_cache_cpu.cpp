// store_cache on CPU: K and V row scatter into flat / paged NHD / paged HND caches, plain copy
// ("auto") or fp8 quantize-on-write.
//
// Algorithm: parse + validate (store_cache_args.h); resolve every slot serially (skip rules, loc_map,
// IndexError before any write); then one pass over the kept rows writes K and V of each row. A row
// is one segment when both source and destination heads are dense (the common case, including
// fused-qkv source views), else one segment per head. Copies use AVX-512 (row_copy.h); fp8
// quantizes in registers (fp8.h). OpenMP above a payload threshold, non-temporal stores when the
// caches dwarf the LLC (scatter.h).
#include <tvm/ffi/function.h>

#include "jitkv/cpu/fp8.h"
#include "jitkv/cpu/row_copy.h"
#include "jitkv/cpu/scatter.h"
#include "store_cache/store_cache_args.h"

namespace jitkv {
namespace {

constexpr const char* kOp = "store_cache";

// One of K / V: where row i comes from and where slot s goes.
struct Side {
  const char* src;
  int64_t src_token, src_head;  // bytes
  CacheGeom cache;
  int64_t segs, seg_elems;  // segments per row (1 when heads merge) and elements per segment
  int64_t src_seg_bytes;
  float scale;
};

inline char* slot_addr(const CacheGeom& c, int64_t s) {
  if (c.block_size == 1) return c.base + s * c.stride_block;
  return c.base + (s / c.block_size) * c.stride_block + (s % c.block_size) * c.stride_token;
}

Side make_side(const SrcGeom& src, const CacheGeom& cache, int64_t heads, int64_t head_dim, int64_t src_es,
               int64_t dst_es) {
  Side s;
  s.src = src.base;
  s.src_token = src.stride_token;
  s.src_head = src.stride_head;
  s.cache = cache;
  bool dense = heads == 1 || (src.stride_head == head_dim * src_es && cache.stride_head == head_dim * dst_es);
  s.segs = dense ? 1 : heads;
  s.seg_elems = dense ? heads * head_dim : head_dim;
  s.src_seg_bytes = s.seg_elems * src_es;
  s.scale = 1.0f;
  return s;
}

// Every destination segment starts on a 64-byte line (required by streaming stores).
bool lines_aligned(const Side& s) {
  const CacheGeom& c = s.cache;
  return cpu::aligned64(c.base) && c.stride_block % 64 == 0 && (c.block_size == 1 || c.stride_token % 64 == 0) &&
         (s.segs == 1 || c.stride_head % 64 == 0);
}

int64_t span_bytes(const CacheGeom& c) {
  return c.block_size > 0 ? (c.num_slots / c.block_size) * cpu::abs64(c.stride_block) : 0;
}

inline void copy_side(const Side& s, int64_t row, int64_t slot, bool nt) {
  const char* src = s.src + row * s.src_token;
  char* dst = slot_addr(s.cache, slot);
  for (int64_t h = 0; h < s.segs; ++h) {
    cpu::copy_seg(dst + h * s.cache.stride_head, src + h * s.src_head, s.src_seg_bytes, nt);
  }
}

inline void quantize_side(const Side& s, int64_t row, int64_t slot, cpu::SrcKind kind, const cpu::Fp8Format& fmt,
                          bool nt) {
  const char* src = s.src + row * s.src_token;
  char* dst = slot_addr(s.cache, slot);
  for (int64_t h = 0; h < s.segs; ++h) {
    cpu::quantize_seg(reinterpret_cast<uint8_t*>(dst + h * s.cache.stride_head), kind, src + h * s.src_head,
                      s.seg_elems, s.scale, fmt, nt);
  }
}

// fp8 conversion costs more per source byte than a copy: weigh its payload so threads start earlier.
constexpr int64_t kQuantizeWeight = 4;

// Writes K and V of every kept row; write(side, row, slot) handles one side of one row.
template <class Write>
void write_rows(const Side& k, const Side& v, const cpu::RowSlot* rows, int64_t m, int threads, bool nt,
                Write write) {
  cpu::for_rows(m, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      write(k, rows[i].row, rows[i].slot);
      write(v, rows[i].row, rows[i].slot);
    }
    if (nt) cpu::stream_fence();
  });
}

void write_all(const StoreCacheArgs& a, const Side& k, const Side& v, const cpu::RowSlot* rows, int64_t m) {
  bool quantize = a.kv_dtype != KVDtype::kAuto;
  int64_t src_bytes = m * (k.segs * k.src_seg_bytes + v.segs * v.src_seg_bytes);
  int64_t dst_bytes = quantize ? m * a.num_heads * (a.k_head_dim + a.v_head_dim) : src_bytes;
  int threads = cpu::threads_for(quantize ? kQuantizeWeight * src_bytes : src_bytes);
  bool nt = cpu::want_streaming(span_bytes(a.k_cache) + span_bytes(a.v_cache), dst_bytes, threads) &&
            lines_aligned(k) && lines_aligned(v);
  if (!quantize) {
    write_rows(k, v, rows, m, threads, nt, [nt](const Side& s, int64_t r, int64_t t) { copy_side(s, r, t, nt); });
    return;
  }
  const cpu::Fp8Format& fmt = a.kv_dtype == KVDtype::kFp8E4M3 ? cpu::kFp8E4M3 : cpu::kFp8E5M2;
  cpu::SrcKind kind = a.src_dtype.code == kDLBfloat ? cpu::SrcKind::kBF16
                      : a.src_dtype.bits == 16      ? cpu::SrcKind::kF16
                                                    : cpu::SrcKind::kF32;
  write_rows(k, v, rows, m, threads, nt, [&](const Side& s, int64_t r, int64_t t) {
    quantize_side(s, r, t, kind, fmt, nt);
  });
}

template <class IdxT>
int64_t resolve(const StoreCacheArgs& a, const IdxT* idx, cpu::RowSlot* out) {
  return cpu::resolve_slots(kOp, "slot_mapping", idx, a.n, a.skip_slot, a.loc_map, a.loc_map_i64, a.loc_map_size,
                            a.k_cache.num_slots, out);
}

void store_cache_cpu(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache, TensorView slot_mapping,
                     Optional<TensorView> loc_map, int64_t skip_slot, int64_t kv_cache_dtype,
                     Optional<TensorView> k_scale, Optional<TensorView> v_scale, double k_scale_value,
                     double v_scale_value) {
  if (k_cache.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << kOp << ": k_cache: expected a CPU tensor for the CPU kernel, got device_type "
                              << k_cache.device().device_type;
  }
  StoreCacheArgs a = parse_store_cache_args(kOp, k, v, k_cache, v_cache, slot_mapping, loc_map, skip_slot,
                                            kv_cache_dtype, k_scale, v_scale, k_scale_value, v_scale_value);
  if (a.n == 0) return;

  cpu::RowSlotBuffer buf(a.n);
  int64_t m = a.slot_i64 ? resolve(a, static_cast<const int64_t*>(a.slot_mapping), buf.data())
                         : resolve(a, static_cast<const int32_t*>(a.slot_mapping), buf.data());
  if (m == 0) return;

  int64_t src_es = elem_bytes(a.src_dtype), dst_es = elem_bytes(k_cache.dtype());
  Side ks = make_side(a.k, a.k_cache, a.num_heads, a.k_head_dim, src_es, dst_es);
  Side vs = make_side(a.v, a.v_cache, a.num_heads, a.v_head_dim, src_es, dst_es);
  if (a.kv_dtype != KVDtype::kAuto) {
    ks.scale = a.k_scale_ptr ? *a.k_scale_ptr : a.k_scale_value;
    vs.scale = a.v_scale_ptr ? *a.v_scale_ptr : a.v_scale_value;
  }
  write_all(a, ks, vs, buf.data(), m);
}

}  // namespace
}  // namespace jitkv

TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_cache, jitkv::store_cache_cpu);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_cache_copy, jitkv::store_cache_copy<jitkv::store_cache_cpu>);
