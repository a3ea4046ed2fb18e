// rope on CPU: rope_store_cache (MHA/GQA) and rope_set_mla_kv_buffer (MLA), docs/design.md §9.
//
// Algorithm: parse (parse.h); check every position, then resolve every slot (skip rules, loc_map,
// IndexError before any write); then one pass over the tokens. Per token: its cos/sin row, expanded to
// rot values (NeoX: [c | c] and [-s | s]; GPT-J: c and -s, s per pair), so that a rotation is
// out = x * C + swap(x) * S, each product rounded before the sum (the module is built with
// -ffp-contract=off). Per head: load into float32, RMSNorm in the fixed order (groups of 8 folded by
// halves, then the group sums by halves: rope/norm_cpu.h; normed heads kNormBatch at a time), rotate,
// then store every destination from the float32 result: round to nearest even (bf16, fp16), or fp8 by
// fp8.h's exact conversion. On AVX2 a head rotated over all its dims into 16-bit rows (q, q_out, k_out,
// the bf16 / fp16 cache, MLA's q_pe) takes one pass through registers instead, a normed one after its
// sums (f32_cpu.h rope_row16, rope_normed_row16: the same arithmetic and rounding). V and the MLA kv_c
// are copied or quantized from their sources as store_cache / set_mla_kv_buffer do. Vectors: AVX-512 or
// AVX2 (jitkv/cpu/isa.h), scalar otherwise; OpenMP above a payload threshold, and the cache rows by
// streaming stores where store_cache / set_mla_kv_buffer would stream them (scatter.h want_streaming).
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "jitkv/cpu/fp8.h"
#include "jitkv/cpu/isa.h"
#include "jitkv/cpu/row_copy.h"
#include "jitkv/cpu/scatter.h"
#include "mla/ds_mla_cpu.h"
#include "mla/rows_cpu.h"
#include "rope/f32_cpu.h"
#include "rope/norm_cpu.h"
#include "rope/parse.h"
#include "store_cache/side_cpu.h"

namespace jitkv {
namespace {

using cpu::SrcKind;
using rope::load_row;
using rope::pow2_at_least;
using rope::rope_normed_row16;
using rope::rope_row16;
using rope::RopeQ;
using rope::rotate;
using rope::row16_takes;
using rope::Rows;
using rope::store_row;
using rope::sum_squares;

constexpr const char* kOp = "rope_store_cache";
constexpr const char* kMlaOp = "rope_set_mla_kv_buffer";

// Rotating, norming and converting cost more per byte than a copy: weigh the payload so threads start
// earlier (the same rule as store_cache's fp8 weight).
constexpr int64_t kRopeWeight = 4;

// Normed heads go through the norm kNormBatch at a time: every head's sum, division, root and reciprocal
// first, then each head scaled and rotated, so that the heads' dependent chains overlap (one head at a
// time, the core waits on each head's chain; docs/performance.md "rope CPU norm batches").
constexpr int64_t kNormBatch = 4;

// Per-thread scratch: kNormBatch heads, the norm's group sums, the token's cos/sin row and its expanded form
// (C, S), and a rounded head (MLA's fp8_ds_mla rope); each array from a 64-byte line of its own, as a
// vector access that crosses a line costs two (a std::vector's storage is only 16-byte aligned, and
// where its heads fell moved rows' times by up to 17 %).
class Scratch {
 public:
  float *x, *g, *cs, *C, *S;
  uint16_t* half;

  explicit Scratch(int64_t width, int64_t rot) {
    const int64_t sizes[] = {kNormBatch * width, pow2_at_least(width / 8), rot, rot, rot, (width + 1) / 2};
    int64_t total = kLine;  // room to move the first array to a line
    for (int64_t n : sizes) total += lines(n);
    buf_.resize(static_cast<size_t>(total));
    float* at = buf_.data() + (kLine - reinterpret_cast<uintptr_t>(buf_.data()) / sizeof(float) % kLine) % kLine;
    float** arrays[] = {&x, &g, &cs, &C, &S};
    for (int i = 0; i < 5; ++i) *arrays[i] = at, at += lines(sizes[i]);
    half = reinterpret_cast<uint16_t*>(at);
  }

 private:
  static constexpr int64_t kLine = 64 / sizeof(float);
  static int64_t lines(int64_t n) { return (n + kLine - 1) / kLine * kLine; }
  std::vector<float> buf_;
};

int64_t position_at(const rope::Rotation& r, int64_t t) {
  return r.pos_i64 ? static_cast<const int64_t*>(r.positions)[t] : static_cast<const int32_t*>(r.positions)[t];
}

// The token's expanded cos/sin row (see the top of this file).
void expand_cos_sin(const rope::Rotation& r, int64_t t, Scratch& s) {
  const char* row = r.cos_sin + position_at(r, t) * r.cs_stride;
  const SrcKind k = cpu::src_kind(r.cs_dtype);
  const int64_t h = r.rot / 2;
  float* c = s.cs;  // cos then sin
  load_row(c, k, row, r.rot);
  for (int64_t i = 0; i < h; ++i) {
    const float cv = c[i], sv = c[h + i];
    if (r.neox) {
      s.C[i] = s.C[h + i] = cv;
      s.S[i] = -sv;
      s.S[h + i] = sv;
    } else {
      s.C[2 * i] = s.C[2 * i + 1] = cv;
      s.S[2 * i] = -sv;
      s.S[2 * i + 1] = sv;
    }
  }
}

// The heads [0, heads) of a side kNormBatch at a time, the norm up to its scaling: the m heads from h0
// loaded into s.x (head b at s.x + b d), inv[b] = 1 / sqrt(mean(x^2) + eps) of each, then f(h0, m, inv).
template <class RowOf, class F>
void norm_batches(SrcKind src, int64_t d, float eps, int64_t heads, RowOf row, Scratch& s, F f) {
  for (int64_t h0 = 0; h0 < heads; h0 += kNormBatch) {
    const int64_t m = std::min(kNormBatch, heads - h0);
    float inv[kNormBatch];
    for (int64_t b = 0; b < m; ++b) load_row(s.x + b * d, src, row(h0 + b), d);
    for (int64_t b = 0; b < m; ++b) {
      const float mean = sum_squares(s.x + b * d, d, s.g) / static_cast<float>(d);
      inv[b] = 1.0f / std::sqrt(mean + eps);
    }
    f(h0, m, inv);
  }
}

// The heads [0, heads) of a side: row(h) the source row of head h, loaded, normed with w (float32, nullptr:
// none), rotated, then store(h, x) with x its float32 values. Normed heads go kNormBatch at a time (see
// kNormBatch); the others one by one.
template <class RowOf, class Store>
void side_heads(const rope::Rotation& r, const float* w, float eps, int64_t d, SrcKind src, int64_t heads, RowOf row,
                Store store, Scratch& s) {
  float* x = s.x;
  if (w == nullptr) {
    for (int64_t h = 0; h < heads; ++h) {
      load_row(x, src, row(h), d);
      rotate(x, s.C, s.S, r.rot, r.neox);
      store(h, x);
    }
    return;
  }
  norm_batches(src, d, eps, heads, row, s, [&](int64_t h0, int64_t m, const float* inv) {
    for (int64_t b = 0; b < m; ++b) {
      float* y = x + b * d;
      for (int64_t i = 0; i < d; ++i) y[i] = (y[i] * inv[b]) * w[i];
    }
    for (int64_t b = 0; b < m; ++b) rotate(x + b * d, s.C, s.S, r.rot, r.neox);
    for (int64_t b = 0; b < m; ++b) store(h0 + b, x + b * d);
  });
}

// side_heads where every head is rotated over all its d dims into a 16-bit row of the sources' kind
// (row16_takes): head h into first(h) (nullptr: none) in one pass through registers (rope_row16, after the
// norm's sums rope_normed_row16), then then(h, first(h)).
template <class RowOf, class First, class Then>
void side_heads16(const rope::Rotation& r, const float* w, float eps, int64_t d, SrcKind src, int64_t heads, RowOf row,
                  First first, Then then, Scratch& s) {
  if (w == nullptr) {
    for (int64_t h = 0; h < heads; ++h) {
      if (char* out = first(h)) {
        rope_row16(out, row(h), src, s.C, s.S, d, r.neox);
        then(h, out);
      }
    }
    return;
  }
  norm_batches(src, d, eps, heads, row, s, [&](int64_t h0, int64_t m, const float* inv) {
    for (int64_t b = 0; b < m; ++b) {
      if (char* out = first(h0 + b)) {
        rope_normed_row16(out, s.x + b * d, inv[b], w, src, s.C, s.S, d, r.neox);
        then(h0 + b, out);
      }
    }
  });
}

// q_out's quantizer (one element) for an fp8 q_out, else none; its setup is shared by every head.
std::vector<cpu::Fp8Quantizer> q_quantizers(const rope::Queries& q) {
  std::vector<cpu::Fp8Quantizer> out;
  if (rope::q_is_fp8(q.mode)) {
    out.emplace_back(cpu::fp8_format(rope::q_format(q.mode)), q.scale_ptr ? *q.scale_ptr : q.scale);
  }
  return out;
}

// s.x (n values) into a destination of kind k, or quantized by fp8 (non-null).
inline void store_head(char* dst, SrcKind k, const float* x, int64_t n, const cpu::Fp8Quantizer* fp8) {
  if (fp8 != nullptr) {
    (*fp8)(reinterpret_cast<uint8_t*>(dst), SrcKind::kF32, x, n, false);
  } else {
    store_row(dst, k, x, n);
  }
}

// store_head into a cache row; nt: by streaming stores (dst 64-byte aligned), a rounded head staged in
// s.half first.
inline void store_cache_head(char* dst, SrcKind k, const float* x, int64_t n, const cpu::Fp8Quantizer* fp8, bool nt,
                             Scratch& s) {
  if (!nt) {
    store_head(dst, k, x, n, fp8);
  } else if (fp8 != nullptr) {
    (*fp8)(reinterpret_cast<uint8_t*>(dst), SrcKind::kF32, x, n, true);
  } else if (k == SrcKind::kF32) {
    cpu::copy_seg(dst, reinterpret_cast<const char*>(x), n * 4, true);
  } else {
    store_row(reinterpret_cast<char*>(s.half), k, x, n);
    cpu::copy_seg(dst, reinterpret_cast<const char*>(s.half), n * 2, true);
  }
}

inline char* row_of(const Rows& r, int64_t t, int64_t h) { return r.ptr + t * r.stride_token + h * r.stride_head; }

// IndexError at the first of positions[0, n) outside [0, max_pos), before anything is written.
void check_positions(const char* op, const rope::Rotation& r, int64_t n) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = position_at(r, t);
    if (p < 0 || p >= r.max_pos) {
      TVM_FFI_THROW(IndexError) << op << ": positions: position " << t << " has value " << p
                                << ", out of range for a cos_sin_cache of " << r.max_pos << " positions";
    }
  }
}

// dest[t] = the slot token t writes, or -1 (padding); IndexError first for an out-of-range slot.
template <class IdxT>
std::vector<int64_t> destinations(const char* op, const char* name, const IdxT* idx, int64_t n, int64_t skip_slot,
                                  const void* map, bool map_i64, int64_t map_size, int64_t num_slots) {
  cpu::RowSlotBuffer kept(n);
  const int64_t m = cpu::resolve_slots(op, name, idx, n, skip_slot, map, map_i64, map_size, num_slots, kept.data());
  std::vector<int64_t> dest(n, -1);
  for (int64_t i = 0; i < m; ++i) dest[kept.data()[i].row] = kept.data()[i].slot;
  return dest;
}

std::vector<float> weight_f32(const void* w, codes::SrcDtype dt, int64_t d) {
  std::vector<float> out;
  if (w != nullptr) {
    out.resize(d);
    load_row(out.data(), cpu::src_kind(dt), static_cast<const char*>(w), d);
  }
  return out;
}

// ---------------------------------------------------------------------------------- MHA / GQA

inline float side_scale(const store_cache::Side& s, int64_t h) {
  return s.scale_stride != 0 ? s.scale_ptr[h * s.scale_stride] : s.scale_ptr ? *s.scale_ptr : s.scale;
}

// The call's fp8 quantizers, set up once (cpu::Fp8Quantizer: its setup costs about as much as
// converting 32 values, a quarter of a 128-value head): q's, and K's and V's, one per head.
struct StoreQuantizers {
  std::vector<cpu::Fp8Quantizer> q, k, v;  // empty: that side is not quantized

  explicit StoreQuantizers(const rope::StoreParams& p) : q(q_quantizers(p.q)) {
    if (p.kv.kv_dtype == codes::KvFormat::kCopy) return;
    const cpu::Fp8Format& fmt = cpu::fp8_format(p.kv.kv_dtype);
    for (int64_t h = 0; h < p.kv.num_heads; ++h) {
      k.emplace_back(fmt, side_scale(p.kv.k, h));
      v.emplace_back(fmt, side_scale(p.kv.v, h));
    }
  }

  static const cpu::Fp8Quantizer* at(const std::vector<cpu::Fp8Quantizer>& side, int64_t h) {
    return side.empty() ? nullptr : &side[static_cast<size_t>(h)];
  }
};

// Token t's q, k and v; its cache rows (slot >= 0) by streaming stores where nt.
void store_token(const rope::StoreParams& p, const StoreQuantizers& fp8, const float* qw, const float* kw, int64_t t,
                 int64_t slot, bool nt, Scratch& s) {
  const auto& kv = p.kv;
  const int64_t d = kv.k_head_dim, src_es = elem_bytes(kv.src_dtype);
  const SrcKind src = cpu::src_kind(kv.src_dtype);
  expand_cos_sin(p.rot, t, s);
  const cpu::Fp8Quantizer* q_fp8 = StoreQuantizers::at(fp8.q, 0);
  const bool one_pass = p.rot.rot == d && row16_takes(src, d);  // 16-bit rows: side_heads16
  const auto q_row = [&](int64_t h) { return row_of(p.q.src, t, h); };
  if (one_pass && q_fp8 == nullptr) {
    side_heads16(
        p.rot, qw, p.eps, d, src, p.q.heads, q_row, [&](int64_t h) { return row_of(p.q.dst, t, h); },
        [](int64_t, const char*) {}, s);
  } else {
    side_heads(
        p.rot, qw, p.eps, d, src, p.q.heads, q_row,
        [&](int64_t h, const float* x) { store_head(row_of(p.q.dst, t, h), src, x, d, q_fp8); }, s);
  }
  const auto k_row = [&](int64_t h) { return kv.k.src + t * kv.k.src_stride_token + h * kv.k.src_stride_head; };
  const auto k_dst = [&](int64_t h) {
    return slot >= 0 ? store_cache::slot_row(kv.k, slot) + h * kv.k.dst_stride_head : nullptr;
  };
  if (one_pass && fp8.k.empty()) {
    // Rotated into k_out, else into the cache row (staged in s.half where it is streamed), then copied on.
    const auto first = [&](int64_t h) -> char* {
      if (p.k_out.ptr != nullptr) return row_of(p.k_out, t, h);
      char* dst = k_dst(h);
      return dst != nullptr && nt ? reinterpret_cast<char*>(s.half) : dst;
    };
    const auto then = [&](int64_t h, const char* out) {
      char* dst = k_dst(h);
      if (dst != nullptr && dst != out) cpu::copy_seg(dst, out, d * src_es, nt);
    };
    side_heads16(p.rot, kw, p.eps, d, src, kv.num_heads, k_row, first, then, s);
  } else {
    side_heads(
        p.rot, kw, p.eps, d, src, kv.num_heads, k_row,
        [&](int64_t h, const float* x) {
          if (p.k_out.ptr != nullptr) store_row(row_of(p.k_out, t, h), src, x, d);
          if (char* dst = k_dst(h)) store_cache_head(dst, src, x, d, StoreQuantizers::at(fp8.k, h), nt, s);
        },
        s);
  }
  if (slot < 0) return;
  for (int64_t h = 0; h < kv.num_heads; ++h) {
    const char* v = kv.v.src + t * kv.v.src_stride_token + h * kv.v.src_stride_head;
    char* dst = store_cache::slot_row(kv.v, slot) + h * kv.v.dst_stride_head;
    if (!fp8.v.empty()) {
      fp8.v[static_cast<size_t>(h)](reinterpret_cast<uint8_t*>(dst), src, v, kv.v_head_dim, nt);
    } else {
      cpu::copy_seg(dst, v, kv.v_head_dim * src_es, nt);
    }
  }
}

// Whether the cache rows go by streaming stores: as store_cache decides for its rows (store_cache::streamed),
// each head written as a segment of its own.
bool streamed_caches(const store_cache::StoreCacheParams& kv, int64_t n, int threads) {
  const int64_t es = kv.kv_dtype == codes::KvFormat::kCopy ? elem_bytes(kv.src_dtype) : 1;
  return store_cache::streamed(kv.k, true, kv.v, true, n * kv.num_heads * (kv.k_head_dim + kv.v_head_dim) * es,
                               threads);
}

template <class IdxT>
std::vector<int64_t> store_destinations(const rope::StoreParams& p) {
  const auto& kv = p.kv;
  return destinations(kOp, "slot_mapping", static_cast<const IdxT*>(kv.slots), kv.n, kv.skip_slot, kv.loc_map,
                      kv.loc_i64, kv.loc_map_size, kv.k.num_slots);
}

void rope_store_cache_cpu(TensorView q, TensorView k, TensorView v, TensorView k_cache, TensorView v_cache,
                          TensorView slot_mapping, TensorView positions, TensorView cos_sin_cache, bool is_neox,
                          int64_t rotary_dim, Optional<TensorView> q_norm_weight, Optional<TensorView> k_norm_weight,
                          double eps, TensorView q_dst, int64_t q_mode, Optional<TensorView> q_scale,
                          double q_scale_value, Optional<TensorView> k_out, Optional<TensorView> loc_map,
                          int64_t skip_slot, int64_t kv_format, Optional<TensorView> k_scale,
                          Optional<TensorView> v_scale, double k_scale_value, double v_scale_value) {
  if (k_cache.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << kOp << ": k_cache: expected a CPU tensor for the CPU kernel";
  }
  const rope::StoreParams p =
      rope::parse_store(kOp, q, k, v, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, is_neox, rotary_dim,
                        q_norm_weight, k_norm_weight, eps, q_dst, q_mode, q_scale, q_scale_value, k_out, loc_map,
                        skip_slot, kv_format, k_scale, v_scale, k_scale_value, v_scale_value);
  const int64_t n = p.kv.n, d = p.kv.k_head_dim;
  if (n == 0) return;
  check_positions(kOp, p.rot, n);
  const std::vector<int64_t> dest = p.kv.slot_i64 ? store_destinations<int64_t>(p) : store_destinations<int32_t>(p);
  const std::vector<float> qw = weight_f32(p.q_norm, p.norm_dtype, d), kw = weight_f32(p.k_norm, p.norm_dtype, d);
  const StoreQuantizers fp8(p);
  const int64_t payload =
      n * ((p.q.heads + p.kv.num_heads) * d + p.kv.num_heads * p.kv.v_head_dim) * elem_bytes(p.kv.src_dtype);
  const int threads = cpu::threads_for(kRopeWeight * payload);
  const bool nt = streamed_caches(p.kv, n, threads);
  cpu::for_rows(n, threads, [&](int64_t begin, int64_t end) {
    Scratch s(std::max(d, p.kv.v_head_dim), p.rot.rot);
    for (int64_t t = begin; t < end; ++t) {
      store_token(p, fp8, qw.empty() ? nullptr : qw.data(), kw.empty() ? nullptr : kw.data(), t, dest[t], nt, s);
    }
    if (nt) cpu::stream_fence();
  });
}

// ---------------------------------------------------------------------------------------- MLA

// The call's fp8 quantizers, set up once (as StoreQuantizers): q_out's, and the row's (e4m3 / e5m2).
struct MlaQuantizers {
  std::vector<cpu::Fp8Quantizer> q, kv;  // empty: not quantized (fp8_ds_mla scales per tile)

  explicit MlaQuantizers(const rope::MlaParams& p) : q(q_quantizers(p.q)) {
    const codes::KvFormat f = p.kv.kv_format;
    if (f == codes::KvFormat::kE4M3 || f == codes::KvFormat::kE5M2) {
      kv.emplace_back(cpu::fp8_format(f), p.kv.scale_ptr ? *p.kv.scale_ptr : p.kv.scale);
    }
  }
};

// Token t's q and its kv_buffer row (slot >= 0), the row by streaming stores where nt.
void mla_token(const rope::MlaParams& p, const MlaQuantizers& fp8, int64_t t, int64_t slot, bool nt, Scratch& s) {
  const auto& kv = p.kv;
  const int64_t es = elem_bytes(kv.dtype), r = p.rot.rot, nope = kv.nope_bytes / es;
  const SrcKind src = cpu::src_kind(kv.dtype);
  const codes::KvFormat format = kv.kv_format;
  expand_cos_sin(p.rot, t, s);
  if (p.q.mode != RopeQ::kNone) {
    const bool in_place = p.q.mode == RopeQ::kInPlace;
    const cpu::Fp8Quantizer* q_fp8 = fp8.q.empty() ? nullptr : &fp8.q[0];
    const int64_t dst_es = q_fp8 != nullptr ? 1 : es;
    for (int64_t h = 0; h < p.q.heads; ++h) {
      char* dst = row_of(p.q.dst, t, h);
      if (!in_place) {
        const char* qn = row_of(p.q_nope, t, h);
        if (q_fp8 != nullptr) {
          (*q_fp8)(reinterpret_cast<uint8_t*>(dst), src, qn, p.nope_q, false);
        } else {
          cpu::copy_seg(dst, qn, p.nope_q * es, false);
        }
        dst += p.nope_q * dst_es;
      }
      if (q_fp8 == nullptr && row16_takes(src, r)) {
        rope_row16(dst, row_of(p.q.src, t, h), src, s.C, s.S, r, p.rot.neox);
        continue;
      }
      load_row(s.x, src, row_of(p.q.src, t, h), r);
      rotate(s.x, s.C, s.S, p.rot.rot, p.rot.neox);
      store_head(dst, src, s.x, r, q_fp8);
    }
  }
  load_row(s.x, src, kv.rope + t * kv.rope_row_stride, r);
  rotate(s.x, s.C, s.S, p.rot.rot, p.rot.neox);
  if (p.k_pe_out.ptr != nullptr) store_row(row_of(p.k_pe_out, t, 0), src, s.x, r);
  if (slot < 0) return;
  char* dst = kv.dst + slot * kv.dst_row_stride;
  const char* kv_c = kv.nope + t * kv.nope_row_stride;
  if (format == codes::KvFormat::kE4M3 || format == codes::KvFormat::kE5M2) {  // rope(k_pe) from float32
    fp8.kv[0](reinterpret_cast<uint8_t*>(dst), src, kv_c, nope, nt);
    fp8.kv[0](reinterpret_cast<uint8_t*>(dst) + nope, SrcKind::kF32, s.x, r, nt && nope % 64 == 0);
    return;
  }
  // rope(k_pe) in kv_c's dtype: rounded into s.half (16-bit), or the float32 values themselves.
  const char* rope_row = reinterpret_cast<const char*>(s.x);
  if (src != SrcKind::kF32) {
    store_row(reinterpret_cast<char*>(s.half), src, s.x, r);
    rope_row = reinterpret_cast<const char*>(s.half);
  }
  if (format == codes::KvFormat::kCopy) {
    cpu::copy_two(dst, kv_c, kv.nope_bytes, rope_row, kv.rope_bytes, nt);
  } else {
    mla::write_ds_mla(dst, src, kv_c, rope_row, nt);
  }
}

void rope_set_mla_kv_buffer_cpu(TensorView kv_buffer, TensorView loc, TensorView kv_c, TensorView k_pe,
                                TensorView positions, TensorView cos_sin_cache, bool is_neox, Optional<TensorView> q_pe,
                                Optional<TensorView> q_nope, Optional<TensorView> q_out, int64_t q_mode,
                                Optional<TensorView> q_scale, double q_scale_value, Optional<TensorView> k_pe_out,
                                int64_t skip_slot, int64_t kv_format, Optional<TensorView> scale, double scale_value) {
  if (kv_buffer.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << kMlaOp << ": kv_buffer: expected a CPU tensor for the CPU kernel";
  }
  const rope::MlaParams p =
      rope::parse_mla(kMlaOp, kv_buffer, loc, kv_c, k_pe, positions, cos_sin_cache, is_neox, q_pe, q_nope, q_out,
                      q_mode, q_scale, q_scale_value, k_pe_out, skip_slot, kv_format, scale, scale_value);
  const int64_t n = p.kv.n;
  if (n == 0) return;
  check_positions(kMlaOp, p.rot, n);
  const std::vector<int64_t> dest = p.kv.loc_i64 ? destinations(kMlaOp, "loc", static_cast<const int64_t*>(p.kv.loc), n,
                                                                p.kv.skip_slot, nullptr, false, 0, p.kv.num_slots)
                                                 : destinations(kMlaOp, "loc", static_cast<const int32_t*>(p.kv.loc), n,
                                                                p.kv.skip_slot, nullptr, false, 0, p.kv.num_slots);
  const int64_t es = elem_bytes(p.kv.dtype);
  const int64_t payload = n * (p.kv.nope_bytes + p.kv.rope_bytes + p.q.heads * (p.nope_q + p.rot.rot) * es);
  const int64_t width = std::max<int64_t>(p.rot.rot, 1);
  const MlaQuantizers fp8(p);
  const int threads = cpu::threads_for(kRopeWeight * payload);
  const bool nt = mla::streamed_rows(p.kv, n * (p.kv.nope_bytes + p.kv.rope_bytes), threads);
  cpu::for_rows(n, threads, [&](int64_t begin, int64_t end) {
    Scratch s(width, p.rot.rot);
    for (int64_t t = begin; t < end; ++t) mla_token(p, fp8, t, dest[t], nt, s);
    if (nt) cpu::stream_fence();
  });
}

}  // namespace
}  // namespace jitkv

TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_store_cache, jitkv::rope_store_cache_cpu);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_set_mla_kv_buffer, jitkv::rope_set_mla_kv_buffer_cpu);
JITKV_CPU_EXPORT_INFO();
