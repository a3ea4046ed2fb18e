// rope_set_mla_kv_buffer's CUDA kernel (the layout of its threads: kernels.cuh, whose rotation dispatch,
// piece alignment and scale loads it shares).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "jitkv/codes.h"
#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/paged.cuh"
#include "jitkv/cuda/vec.cuh"
#include "rope/kernels.cuh"
#include "rope/lanes.cuh"
#include "rope/params.h"

namespace jitkv::rope {

using codes::DsMla;

// rope_set_mla_kv_buffer's build: kv_c and k_pe widths (values), the source dtype, the queries'
// destination, the row format and whether the rows' slots come from FlashInfer's page table (kPaged);
// NeoX or GPT-J and the cos/sin dtype pick the kernel.
template <int kNope_, int kRope_, SrcDtype kSrc_, RopeQ kQ_, KvFormat kFmt_, bool kPaged_>
struct MlaShape {
  static constexpr int kNope = kNope_, kRope = kRope_;
  static constexpr bool kPaged = kPaged_;
  using Args = std::conditional_t<kPaged, PagedMlaArgs, MlaArgs>;  // the kernel's parameter block
  static constexpr SrcDtype kSrc = kSrc_;
  static constexpr RopeQ kQ = kQ_;
  static constexpr KvFormat kFmt = kFmt_;
  static constexpr int kV = lane_values<kSrc>();
  static constexpr int kRopeLanes = kRope / kV;
  static constexpr int kG = pow2_at_least(kRopeLanes);
  static constexpr int kNopeLanes = kNope / kV;
  static constexpr int kNopePieces = (kNopeLanes + kG - 1) / kG;
  static constexpr int kKvPieces = kNopePieces + 1;
  static constexpr bool kDs = kFmt == KvFormat::kDsMla;
  static constexpr bool kWithQ = kQ != RopeQ::kNone;
  static_assert(kNope % kV == 0 && kRope % kV == 0 && kG <= 32, "rows of whole lanes, k_pe in a warp");
  static_assert(LaneRotation<kRope, false, kV>::kOk, "rotated dims in whole lanes");
  static_assert(!kDs || (kNope == DsMla::kNope && kRope == DsMla::kRope && kV == 8 && kNopePieces * kG == 64),
                "fp8_ds_mla: 512 + 64 16-bit values, the tiles in the token's first two warps");

  // Where a token's pieces lie, hpt query heads per thread (dividing the head count): kv_c's from 0,
  // k_pe's after them, then from the first whole warp after it every group's q_nope pieces (q_out: its
  // nope_q_lanes in pieces of kG), then from the first whole warp after those every group's q_pe piece,
  // so that no warp holds two paths (a warp runs them one after the other).
  template <class T>
  struct Pieces {
    T nope_per_group, q_nope_begin, q_pe_begin, end;
    __host__ __device__ Pieces(T q_heads, int nope_q_lanes, int hpt)
        : nope_per_group((nope_q_lanes + kG - 1) / kG),
          q_nope_begin(warp_up<kG>(T{kKvPieces})),
          q_pe_begin(warp_up<kG>(q_nope_begin + q_heads / hpt * nope_per_group)),
          end(kWithQ ? q_pe_begin + q_heads / hpt : T{kKvPieces}) {}
  };

  // Threads of one token (whole warps).
  static int64_t token_threads(int64_t q_heads, int nope_q_lanes, int hpt) {
    return (Pieces<int64_t>(q_heads, nope_q_lanes, hpt).end * kG + 31) / 32 * 32;
  }
};

// The row of a loaded loc entry s, or -1 for none.
__device__ __forceinline__ int64_t kept_slot(const MlaArgs& p, int64_t s) {
  return s < 0 || s == p.skip_slot || s >= p.num_slots ? -1 : s;
}

// A token's loc entry, loaded before the trigger, value() after it.
struct LocEntry {
  LoadedIndex entry;
  __device__ __forceinline__ LocEntry(const MlaArgs& p, int64_t t) : entry(load_index_later(p.loc, p.loc_i64, t)) {}
  __device__ __forceinline__ int64_t value(const MlaArgs&) const { return entry.value(); }
};

// A row's slot source: loc, or (a paged build) the token's page-table entries (cuda::TableSlot).
template <class S>
using MlaSlot = std::conditional_t<S::kPaged, cuda::TableSlot, LocEntry>;

// Lane c of kv_c: copied, quantized by the per-tensor scale, or into an fp8_ds_mla tile (the tile's
// amax over its 16 lanes: the first two warps of the token hold the four tiles).
template <class S>
__device__ __forceinline__ void store_kv_c(const typename S::Args& p, int64_t t, int c) {
  const bool inside = c < S::kNopeLanes;
  const MlaSlot<S> slot_in(p, t);
  cuda::Pack<16> v = {};
  if (inside) v = cuda::load_pack<16>(p.kv_c + t * p.kv_c_stride + c * 16);
  float scale = 1.0f;
  if constexpr (S::kFmt == KvFormat::kE4M3 || S::kFmt == KvFormat::kE5M2) {
    scale = load_scale(p.scale_ptr, 0, p.scale);
  }
  cuda::pdl_launch_dependents();
  const int64_t slot = kept_slot(p, slot_in.value(p));
  if constexpr (S::kDs) {
    uint32_t amax = cuda::vec_amax_no_nan<S::kSrc>(make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]));
#pragma unroll
    for (int off = 8; off >= 1; off /= 2) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    scale = cuda::amax_scale<S::kSrc>(amax, DsMla::kFP8Max);
  }
  if (!inside || slot < 0) return;
  char* row = p.dst + slot * p.dst_stride;
  if constexpr (S::kDs) {
    store_source<S::kSrc, KvFormat::kE4M3>(row + c * 8, v, cuda::Divider(scale));
    if (c % 16 == 0) *reinterpret_cast<float*>(row + DsMla::kScaleOffset + 4 * (c / 16)) = scale;
  } else {
    cuda::with_divider(scale, [&](const auto& div) {
      store_source<S::kSrc, S::kFmt>(row + c * dst_lane_bytes<S::kSrc, S::kFmt>(), v, div);
    });
  }
}

// Where slot's rope part starts: after the kv_c part in its row (at row), or at the paged block's rope_dst
// row.
template <class S>
__device__ __forceinline__ char* rope_part(const typename S::Args& p, char* row, int64_t slot) {
  if constexpr (S::kPaged) {
    return p.rope_dst + slot * p.rope_dst_stride;
  } else {
    return row + S::kNopeLanes * dst_lane_bytes<S::kSrc, S::kFmt>();
  }
}

// Lane j of k_pe: rotated, into k_pe_out and the row's rope part.
template <class S, bool kNeox, SrcDtype kCs>
__device__ __forceinline__ void rope_k_pe(const typename S::Args& p, int64_t t, int j) {
  constexpr int kV = S::kV;
  using R = LaneRotationFor<S::kRope, kNeox, kV>;
  const unsigned mask = group_mask<S::kG>();
  const bool inside = j < S::kRopeLanes;
  const LoadedIndex pos_in = load_index_later(p.positions, p.pos_i64, t);
  const MlaSlot<S> slot_in(p, t);
  cuda::Pack<16> v = {};
  if (inside) v = load_lane<R, elem_bytes_of<S::kSrc>()>(p.k_pe + t * p.k_pe_stride, j);
  float scale = 1.0f;
  if constexpr (S::kFmt == KvFormat::kE4M3 || S::kFmt == KvFormat::kE5M2) {
    scale = load_scale(p.scale_ptr, 0, p.scale);
  }
  cuda::pdl_launch_dependents();
  const int64_t pos = clamp_position(pos_in.value(), p.max_pos);
  const int64_t slot = kept_slot(p, slot_in.value(p));
  float c[R::kCs] = {}, s[R::kCs] = {};
  load_cos_sin<R, kCs>(p.cos_sin + pos * p.cs_stride, j, c, s);
  float y[kV];
  to_floats<S::kSrc>(v, y);
  rotate<R, S::kG>(y, j, c, s, mask);
  if (!inside) return;
  const cuda::Divider copy(1.0f);  // unused by a copy's stores
  if (p.k_pe_out != nullptr)
    store_floats_lane<S::kSrc, KvFormat::kCopy, R>(p.k_pe_out + t * p.k_pe_out_stride, j, y, copy);
  if (slot < 0) return;
  char* row = p.dst + slot * p.dst_stride;
  if constexpr (S::kDs) {
    store_floats_lane<S::kSrc, KvFormat::kCopy, R>(row + DsMla::kRopeOffset, j, y, copy);
  } else {
    cuda::with_divider(
        scale, [&](const auto& div) { store_floats_lane<S::kSrc, S::kFmt, R>(rope_part<S>(p, row, slot), j, y, div); });
  }
}

// Lane c of the kHpt query heads h0, h0 + 1, ...'s q_nope: copied or quantized into q_out.
template <class S, int kHpt>
__device__ __forceinline__ void store_q_nope(const MlaArgs& p, int64_t t, int h0, int c) {
  constexpr KvFormat kOut = q_format(S::kQ);
  const bool inside = c < p.nope_q_lanes;
  const char* src = p.q_nope + t * p.q_nope_token + h0 * p.q_nope_head + c * 16;
  cuda::Pack<16> v[kHpt] = {};
#pragma unroll
  for (int u = 0; u < kHpt; ++u) {
    if (inside) v[u] = cuda::load_pack<16>(src + u * p.q_nope_head);
  }
  float scale = 1.0f;
  if constexpr (kOut != KvFormat::kCopy) scale = load_scale(p.q_scale_ptr, 0, p.q_scale);
  cuda::pdl_launch_dependents();
  if (!inside) return;
  char* row = p.q_dst + t * p.q_dst_token + h0 * p.q_dst_head + c * dst_lane_bytes<S::kSrc, kOut>();
  cuda::with_divider(scale, [&](const auto& div) {
#pragma unroll
    for (int u = 0; u < kHpt; ++u) store_source<S::kSrc, kOut>(row + u * p.q_dst_head, v[u], div);
  });
}

// Lane j of the kHpt query heads h0, h0 + 1, ...'s q_pe: rotated (one cos/sin row for all), in place or
// after q_nope in q_out.
template <class S, int kHpt, bool kNeox, SrcDtype kCs>
__device__ __forceinline__ void rope_q_pe(const MlaArgs& p, int64_t t, int h0, int j) {
  constexpr int kV = S::kV;
  using R = LaneRotationFor<S::kRope, kNeox, kV>;
  constexpr KvFormat kOut = q_format(S::kQ);
  constexpr int kLane = dst_lane_bytes<S::kSrc, kOut>();
  const unsigned mask = group_mask<S::kG>();
  const bool inside = j < S::kRopeLanes;
  const LoadedIndex pos_in = load_index_later(p.positions, p.pos_i64, t);
  const char* src = p.q_pe + t * p.q_pe_token + h0 * p.q_pe_head;
  cuda::Pack<16> v[kHpt] = {};
#pragma unroll
  for (int u = 0; u < kHpt; ++u) {
    if (inside) v[u] = load_lane<R, elem_bytes_of<S::kSrc>()>(src + u * p.q_pe_head, j);
  }
  float scale = 1.0f;
  if constexpr (kOut != KvFormat::kCopy) scale = load_scale(p.q_scale_ptr, 0, p.q_scale);
  cuda::pdl_launch_dependents();
  const int64_t pos = clamp_position(pos_in.value(), p.max_pos);
  float c[R::kCs] = {}, s[R::kCs] = {};
  load_cos_sin<R, kCs>(p.cos_sin + pos * p.cs_stride, j, c, s);
  char* row = p.q_dst + t * p.q_dst_token + h0 * p.q_dst_head + int64_t{p.nope_q_lanes} * kLane;
  cuda::with_divider(scale, [&](const auto& div) {  // one branch around every head (rope_heads)
#pragma unroll
    for (int u = 0; u < kHpt; ++u) {
      float y[kV];
      to_floats<S::kSrc>(v[u], y);
      rotate<R, S::kG>(y, j, c, s, mask);
      if (inside) store_floats_lane<S::kSrc, kOut, R>(row + u * p.q_dst_head, j, y, div);
    }
  });
}

// kHpt, kNeox, kCs: as rope_store_cache_kernel's.
template <class S, int kHpt, bool kNeox, SrcDtype kCs>
__global__ void __launch_bounds__(mla_block_bounds(kHpt))
    rope_set_mla_kv_buffer_kernel(const __grid_constant__ typename S::Args p) {
  cuda::warm_params(p, p.n);
  const int64_t t = blockIdx.x;
  const int r = int(blockIdx.y * blockDim.x + threadIdx.x);
  const int piece = r / S::kG, j = r % S::kG;
  const typename S::template Pieces<int> at(p.q_heads, p.nope_q_lanes, kHpt);
  const bool gap = (piece >= S::kKvPieces && piece < at.q_nope_begin) || piece >= at.end ||
                   (piece >= at.q_nope_begin + p.q_heads / kHpt * at.nope_per_group && piece < at.q_pe_begin);
  if (gap) return;  // the gaps before a warp and the token's last warp: whole groups
  cuda::pdl_wait();
  if (piece < S::kNopePieces) {
    store_kv_c<S>(p, t, r);
  } else if (piece == S::kNopePieces) {
    rope_k_pe<S, kNeox, kCs>(p, t, j);
  } else if constexpr (S::kWithQ) {
    if (piece < at.q_pe_begin) {
      const int q = piece - at.q_nope_begin;
      store_q_nope<S, kHpt>(p, t, q / at.nope_per_group * kHpt, q % at.nope_per_group * S::kG + j);
    } else {
      rope_q_pe<S, kHpt, kNeox, kCs>(p, t, (piece - at.q_pe_begin) * kHpt, j);
    }
  }
}

}  // namespace jitkv::rope
