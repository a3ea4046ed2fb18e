// rope's CUDA kernels (docs/design.md §9): one thread per 16 source bytes, a head's lanes in a group
// of G (lanes.cuh; NeoX of 16-bit values in split lanes, each holding both halves of its pairs: no
// exchange between lanes, docs/performance.md "rope split lanes"). A token's threads are pieces of G lanes,
// warp-aligned from the token's first thread (grid.x: tokens, grid.y: blocks of the token's threads):
//  - rope_store_cache_kernel: q heads, then k heads, then v heads (a v head in as many pieces as its
//    Dv / kV lanes take), each kind from a warp's start (StoreShape::Pieces);
//  - rope_set_mla_kv_buffer_kernel (mla_kernels.cuh): kv_c's lanes (the fp8_ds_mla tiles: 16 lanes
//    each, the first 64 threads), k_pe's piece, then the query heads' q_nope pieces (q_out), then their
//    q_pe pieces, each kind from a warp's start (MlaShape::Pieces).
// Each thread: addresses, the PDL wait, its loads (index, position, source, norm weights, scale), the
// trigger for the next kernel, then the index and position widened and checked and the weights made
// float32 (cuda::LoadedIndex, lanes.cuh NormWeights), the cos/sin loads, the arithmetic and the stores. Where
// the trigger sits against the loads and their uses moves the n <= 8 latency by up to 0.2 µs either way;
// this order measured fastest of four (docs/performance.md "rope trigger"). A position outside the table
// is clamped into it; a slot < 0, == skip_slot, outside loc_map or mapped outside the cache is not
// written (q, k_out, k_pe_out are written for every token).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "jitkv/codes.h"
#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/paged.cuh"
#include "jitkv/cuda/vec.cuh"
#include "rope/geometry.h"
#include "rope/lanes.cuh"
#include "rope/params.h"

namespace jitkv::rope {

using codes::RopeNorm;

template <bool kNeox>
using NeoxTag = std::integral_constant<bool, kNeox>;
template <SrcDtype kCs>
using CsTag = std::integral_constant<SrcDtype, kCs>;
template <int kHpt>
using HptTag = std::integral_constant<int, kHpt>;

// f(NeoxTag, CsTag, HptTag) for the call's rotation (NeoX halves or GPT-J pairs), cos/sin dtype (float32,
// else the sources' kSrc) and heads per thread (1, kBulkHpt, or kPairHpt in a build with kPairs), picked
// on the host: each is a kernel template argument, so that a kernel holds only the path its threads run
// (one kernel branching to all four rotations measured slower at n <= 64: docs/performance.md "rope
// trigger"). A NeoX kernel exists where its halves are whole lanes (the binding sends no other call to
// the kernel).
template <int kRot, SrcDtype kSrc, bool kPairs, class F>
auto with_rotation(const Rotation& rot, int hpt, F&& f) {
  const auto with_hpt = [&](auto neox, auto cs) {
    if constexpr (kPairs) {
      if (hpt == kPairHpt) return f(neox, cs, HptTag<kPairHpt>{});
    }
    return hpt == kBulkHpt ? f(neox, cs, HptTag<kBulkHpt>{}) : f(neox, cs, HptTag<1>{});
  };
  constexpr bool kNeoxOk = LaneRotation<kRot, true, lane_values<kSrc>()>::kOk;
  if (rot.cs_dtype == SrcDtype::kF32 || kSrc == SrcDtype::kF32) {
    if constexpr (kNeoxOk) {
      if (rot.neox) return with_hpt(NeoxTag<true>{}, CsTag<SrcDtype::kF32>{});
    }
    return with_hpt(NeoxTag<false>{}, CsTag<SrcDtype::kF32>{});
  }
  if constexpr (kNeoxOk) {
    if (rot.neox) return with_hpt(NeoxTag<true>{}, CsTag<kSrc>{});
  }
  return with_hpt(NeoxTag<false>{}, CsTag<kSrc>{});
}

// The first piece of kG lanes at or after `pieces` that starts a warp (the Pieces layouts below).
template <int kG, class T>
__host__ __device__ T warp_up(T pieces) {
  constexpr int kPerWarp = 32 / kG;
  return (pieces + kPerWarp - 1) / kPerWarp * kPerWarp;
}

// rope_store_cache's build: q/k head dim, v head dim, rotary dim, the sources' dtype, the queries'
// destination, the caches' format, which heads are normed (kNorms: codes::RopeNorm bits) and the norm
// weights' dtype (float32 or the sources'; NONE without norms) and where the slots come from. NeoX or
// GPT-J and the cos/sin dtype pick the kernel. The norms are the build's, not the block's: a branch on
// the block around the norm slows the normed kernels and keeps the norm's code in every module
// (docs/performance.md "rope norms in the build").
template <int kD_, int kDv_, int kRot_, SrcDtype kSrc_, RopeQ kQ_, KvFormat kFmt_, int kNorms_, SrcDtype kNormDtype_,
          bool kPaged_>
struct StoreShape {
  static constexpr int kD = kD_, kDv = kDv_, kRot = kRot_;
  static constexpr bool kPaged = kPaged_;  // slots from FlashInfer's page table, not slots[t]
  using Args = std::conditional_t<kPaged, PagedStoreArgs, StoreArgs>;  // the kernel's parameter block
  static constexpr SrcDtype kSrc = kSrc_;
  static constexpr RopeQ kQ = kQ_;
  static constexpr KvFormat kFmt = kFmt_;
  static constexpr int kNorms = kNorms_;
  static constexpr SrcDtype kNormDtype = kNormDtype_;
  static_assert((kNorms & ~(RopeNorm::kQ | RopeNorm::kK)) == 0, "kNorms: codes::RopeNorm bits");
  static_assert(kNorms == 0 || kNormDtype == SrcDtype::kF32 || kNormDtype == kSrc, "norm weights: f32 or kSrc");
  static constexpr int kV = lane_values<kSrc>();
  static constexpr int kLanes = kD / kV;  // of a q or k head
  static constexpr int kG = pow2_at_least(kLanes);
  static constexpr int kVLanes = kDv / kV;
  static constexpr int kVPieces = (kVLanes + kG - 1) / kG;
  static constexpr bool kPairs = kNorms == 0 && q_format(kQ) != KvFormat::kCopy;  // pair_heads
  static_assert(kD % kV == 0 && kDv % kV == 0 && kG <= 32, "heads of whole lanes, at most a warp");
  static_assert(LaneRotation<kRot, false, kV>::kOk, "rotated dims in whole lanes");

  // Where a token's pieces lie, hpt heads per thread (dividing both head counts): the q heads' from 0,
  // the k heads' from the first whole warp after them, the v heads' from the first whole warp after
  // those, so that no warp holds two paths (a warp runs them one after the other).
  template <class T>
  struct Pieces {
    T q_end, k_begin, k_end, v_begin, end;
    __host__ __device__ Pieces(T q_heads, T kv_heads, int hpt)
        : q_end(q_heads / hpt),
          k_begin(warp_up<kG>(q_end)),
          k_end(k_begin + kv_heads / hpt),
          v_begin(warp_up<kG>(k_end)),
          end(v_begin + kv_heads / hpt * kVPieces) {}
  };

  // Threads of one token (whole warps).
  static int64_t token_threads(int64_t q_heads, int64_t kv_heads, int hpt) {
    return (Pieces<int64_t>(q_heads, kv_heads, hpt).end * kG + 31) / 32 * 32;
  }
};

// The cache slot of a loaded slot_mapping entry s, or -1 for none (a second load through loc_map).
__device__ __forceinline__ int64_t kept_slot(const StoreArgs& p, int64_t s, int64_t num_slots) {
  if (s < 0 || s == p.skip_slot) return -1;
  if (p.loc_map != nullptr) {
    if (s >= p.loc_map_size) return -1;
    s = load_index(p.loc_map, p.loc_i64, s);
  }
  return uint64_t(s) < uint64_t(num_slots) ? s : -1;
}

// The cache row of a paged build's walk (SlotIn::walk) plus head_offset, or nullptr for none: the page's
// row at page * block_stride + row * token, the page checked against the cache's blocks. The page size is
// the caches' block size and the build takes no loc_map or skip_slot (the binding's checks), so the slot
// is not divided into its block again.
__device__ __forceinline__ char* paged_row(const cuda::PageWalk& w, char* cache, int64_t block_stride, int64_t token,
                                           int64_t blocks, int64_t head_offset) {
  const int64_t page = w.page.value();
  if (w.none || uint64_t(page) >= uint64_t(blocks)) return nullptr;
  return cache + page * block_stride + w.row * token + head_offset;
}

// A token's slot as loaded before the trigger: slots[t] (value()), or in a paged build (kPaged) the token's
// request, its sequence position and kv_indptr[t] (cuda::indptr_guess), whose table walk follows the
// trigger: walk() issues it up to its kv_indices load (cuda::page_table_walk; paged_row reads it).
// rope_heads issues its cos/sin loads first, or they would wait on the walk's branches.
template <bool kPaged>
struct SlotIn {
  LoadedIndex entry = {}, pos = {}, start = {};
  int64_t t = 0;  // the token (the guess's request)
  SlotIn() = default;
  template <class Args>
  __device__ __forceinline__ SlotIn(const Args& p, int64_t t_)
      : entry(load_index_later(p.slots, p.slot_i64, t_)), t(t_) {
    if constexpr (kPaged) {
      pos = load_index_later(p.pages.positions, p.pages.pos_i64, t);
      start = load_index_later(p.pages.kv_indptr, p.pages.indptr_i64, cuda::indptr_guess(p.pages, t));
    }
  }
  __device__ __forceinline__ int64_t value() const {
    static_assert(!kPaged, "a paged build's slot is its walk's (paged_row)");
    return entry.value();
  }
  // The slot as a pending load: slots[t], or in a paged build the walk issued up to its kv_indices load.
  template <class Args>
  __device__ __forceinline__ auto walk(const Args& p) const {
    if constexpr (kPaged) {
      return cuda::page_table_walk(p.pages, entry.value(), pos.value(), t, start.value());
    } else {
      return entry;
    }
  }
};

__device__ __forceinline__ float load_scale(const float* ptr, int64_t at, float value) {
  return ptr != nullptr ? cuda::load(ptr + at) : value;
}

// kHpt q heads (kIsK false) or k heads h0, h0 + 1, ... with the rotation kNeox and a cos/sin table of
// dtype kCs: loads, the trigger, norm, rotation and the stores. The position, slot, cos/sin row and norm
// weights serve all kHpt heads.
template <class S, int kHpt, bool kIsK, bool kNeox, SrcDtype kCs>
__device__ __forceinline__ void rope_heads(const typename S::Args& p, int64_t t, int h0, int j) {
  constexpr int kV = S::kV;
  constexpr KvFormat kOut = kIsK ? S::kFmt : q_format(S::kQ);
  using R = LaneRotationFor<S::kRot, kNeox, kV>;
  constexpr int kEs = elem_bytes_of<S::kSrc>();
  const unsigned mask = group_mask<S::kG>();
  const bool inside = j < S::kLanes;
  const int64_t head = kIsK ? p.k_src_head : p.q_src_head;
  const char* src = (kIsK ? p.k_src + t * p.k_src_token : p.q_src + t * p.q_src_token) + h0 * head;
  constexpr bool kNorm = (S::kNorms & (kIsK ? RopeNorm::kK : RopeNorm::kQ)) != 0;
  const char* norm = kIsK ? p.k_norm : p.q_norm;
  const LoadedIndex pos_in = load_index_later(p.positions, p.pos_i64, t);
  SlotIn<S::kPaged> slot_in = kIsK ? SlotIn<S::kPaged>(p, t) : SlotIn<S::kPaged>{};
  cuda::Pack<16> v[kHpt] = {};
#pragma unroll
  for (int u = 0; u < kHpt; ++u) {
    if (inside) v[u] = load_lane<R, kEs>(src + u * head, j);
  }
  NormWeights<kV, S::kNormDtype> w_in;
  if constexpr (kNorm) w_in.template load<R>(norm, j, inside);
  float scale[kHpt];
#pragma unroll
  for (int u = 0; u < kHpt; ++u) {
    scale[u] = 1.0f;
    if constexpr (kOut != KvFormat::kCopy) {
      // q: one q_scale, loaded once (the scale loads are volatile: the compiler keeps each)
      scale[u] = kIsK     ? load_scale(p.k_scale_ptr, int64_t{h0 + u} * p.k_scale_stride, p.k_scale)
                 : u == 0 ? load_scale(p.q_scale_ptr, 0, p.q_scale)
                          : scale[0];
    }
  }
  cuda::pdl_launch_dependents();  // before the loaded values are used (kernel comment)
  const int64_t pos = clamp_position(pos_in.value(), p.max_pos);
  float c[R::kCs] = {}, s[R::kCs] = {};
  if constexpr (S::kPaged) load_cos_sin<R, kCs>(p.cos_sin + pos * p.cs_stride, j, c, s);  // ahead of the walk
  // K's slot: a paged build reads its walk's after the first head's rotation (in the store below), so
  // that the rotation does not wait for the kv_indices load.
  const auto walk = kIsK ? slot_in.walk(p) : decltype(slot_in.walk(p)){};
  int64_t slot = -1;
  if constexpr (kIsK && !S::kPaged) slot = kept_slot(p, walk.value(), p.k_num_slots);
  const auto row_of = [&](int64_t at) -> char* {
    if (at < 0) return nullptr;
    const int64_t blk = int64_t(cuda::block_of(at, p.k_magic, p.k_shift));
    return p.k_cache + at * p.k_token + blk * p.k_block_adj + h0 * p.k_head;
  };
  float w[kV];
  if constexpr (kNorm) w_in.floats(w);
  if constexpr (!S::kPaged) load_cos_sin<R, kCs>(p.cos_sin + pos * p.cs_stride, j, c, s);
  char* k_row = kIsK && !S::kPaged ? row_of(slot) : nullptr;
  // Rotated heads, each handed to store(u, y) where it is inside the head.
  const auto heads = [&](const auto& store) {
#pragma unroll
    for (int u = 0; u < kHpt; ++u) {
      float y[kV];
      to_floats<S::kSrc>(v[u], y);
      if constexpr (kNorm) rms_norm<R, S::kD, S::kG>(y, w, p.eps, j, mask);
      rotate<R, S::kG>(y, j, c, s, mask);
      if (inside) store(u, y);
    }
  };
  if constexpr (kIsK) {  // a scale per head: a divider branch per head
    heads([&](int u, const float (&y)[kV]) {
      if constexpr (S::kPaged) {
        if (u == 0) k_row = paged_row(walk, p.k_cache, p.k_block_stride, p.k_token, p.k_blocks, h0 * p.k_head);
      }
      cuda::with_divider(scale[u], [&](const auto& div) {
        if (p.k_out != nullptr) {
          store_floats_lane<S::kSrc, KvFormat::kCopy, R>(p.k_out + t * p.k_out_token + (h0 + u) * p.k_out_head, j, y,
                                                         div);
        }
        if (k_row != nullptr) store_floats_lane<S::kSrc, kOut, R>(k_row + u * p.k_head, j, y, div);
      });
    });
  } else {  // one q_scale: one branch around every head, so the unrolled heads stay one block
    cuda::with_divider(scale[0], [&](const auto& div) {
      heads([&](int u, const float (&y)[kV]) {
        store_floats_lane<S::kSrc, kOut, R>(p.q_dst + t * p.q_dst_token + (h0 + u) * p.q_dst_head, j, y, div);
      });
    });
  }
}

// Lanes c of the kHpt v heads h0, h0 + 1, ...: copied or quantized into v_cache.
template <class S, int kHpt>
__device__ __forceinline__ void store_v(const typename S::Args& p, int64_t t, int h0, int c) {
  const bool inside = c < S::kVLanes;
  const SlotIn<S::kPaged> slot_in(p, t);
  const char* src = p.v_src + t * p.v_src_token + h0 * p.v_src_head + c * 16;
  cuda::Pack<16> v[kHpt] = {};
  float scale[kHpt];
#pragma unroll
  for (int u = 0; u < kHpt; ++u) {
    if (inside) v[u] = cuda::load_pack<16>(src + u * p.v_src_head);
    scale[u] = 1.0f;
    if constexpr (S::kFmt != KvFormat::kCopy) {
      scale[u] = load_scale(p.v_scale_ptr, int64_t{h0 + u} * p.v_scale_stride, p.v_scale);
    }
  }
  cuda::pdl_launch_dependents();
  char* row;
  if constexpr (S::kPaged) {
    row = paged_row(slot_in.walk(p), p.v_cache, p.v_block_stride, p.v_token, p.v_blocks, h0 * p.v_head);
    if (!inside || row == nullptr) return;
  } else {
    const int64_t slot = kept_slot(p, slot_in.value(), p.v_num_slots);
    if (!inside || slot < 0) return;
    const int64_t blk = int64_t(cuda::block_of(slot, p.v_magic, p.v_shift));
    row = p.v_cache + slot * p.v_token + blk * p.v_block_adj + h0 * p.v_head;
  }
#pragma unroll
  for (int u = 0; u < kHpt; ++u) {
    cuda::with_divider(scale[u], [&](const auto& div) {
      store_source<S::kSrc, S::kFmt>(row + u * p.v_head + c * dst_lane_bytes<S::kSrc, S::kFmt>(), v[u], div);
    });
  }
}

// Blocks per SM a kernel is built for (__launch_bounds__' second argument; 0: none, ptxas's choice): 8
// for the normed NeoX kBulkHpt kernels with fp8 caches, whose registers ptxas otherwise sets at 72 (7
// blocks of 128 per SM) where 64 hold them without a spill; the GPT-J ones spill at 64 and keep ptxas's
// choice, as does every other kernel (a minimum they did not have changes their code). Re-measure:
// docs/performance.md "The kBulkHpt kernels' prologue".
template <class S, int kHpt, bool kNeox>
constexpr int min_blocks() {
  return kNeox && S::kNorms != 0 && S::kFmt != KvFormat::kCopy && kHpt == kBulkHpt ? 8 : 0;
}

// kHpt: heads per thread (1 for latency; more at large n, so that each thread has that many loads in
// flight and reads the cos/sin row once for them; the binding picks it, heads_per_thread). kNeox, kCs:
// the rotation and the cos/sin table's dtype (with_rotation). The kBulkHpt kernels run many blocks an
// SM, whose parameter block is warm after the first: they skip warm_params (16 instructions of each
// warp) and take the piece bounds unsigned (the head counts are positive, the binding checks them), so
// that their quotients are shifts; the other kernels keep the code their latency was measured with.
template <class S, int kHpt, bool kNeox, SrcDtype kCs>
__global__ void __launch_bounds__(block_bounds(S::kNorms != 0, kHpt), (min_blocks<S, kHpt, kNeox>()))
    rope_store_cache_kernel(const __grid_constant__ typename S::Args p) {
  constexpr bool kBulk = kHpt == kBulkHpt;
  using T = std::conditional_t<kBulk, unsigned, int>;
  if constexpr (!kBulk) cuda::warm_params(p, p.n);
  const int64_t t = blockIdx.x;
  const T r = T(blockIdx.y * blockDim.x + threadIdx.x);
  const T piece = r / S::kG;
  const int j = int(r % S::kG);
  const typename S::template Pieces<T> at(T(p.q_heads), T(p.kv_heads), kHpt);
  const bool is_q = piece < at.q_end, is_k = piece >= at.k_begin && piece < at.k_end;
  const bool is_v = piece >= at.v_begin && piece < at.end;
  if (!is_q && !is_k && !is_v) return;  // the gaps before a warp and the token's last warp: whole groups
  cuda::pdl_wait();
  if (!is_v) {
    const int h0 = int(is_k ? piece - at.k_begin : piece) * kHpt;
    if (is_k) {
      rope_heads<S, kHpt, true, kNeox, kCs>(p, t, h0, j);
    } else {
      rope_heads<S, kHpt, false, kNeox, kCs>(p, t, h0, j);
    }
  } else {
    const int v = int(piece - at.v_begin);
    store_v<S, kHpt>(p, t, v / S::kVPieces * kHpt, (v % S::kVPieces) * S::kG + j);
  }
}

}  // namespace jitkv::rope
