// set_mla_kv_buffer's fp8 writers: bf16/fp16 rows quantized to e4m3 / e5m2 with a per-tensor scale, or
// to the fp8_ds_mla record (codes::DsMla). stored = fp8(x / scale) with the correctly rounded fp32
// quotient (cuda::Divider, no branch; the generic kernel: __fdiv_rn) and the hardware's conversion
// (jitkv/cuda/fp8.cuh): bit-equal to torch's (x.float() / scale).clamp(-max, max).to(float8) on the GPU.
//  - fast kernel (16-byte aligned sources): the copy latency kernel's pattern with one or two warps per
//    row, an exact branch-free division per value, fp8_ds_mla's tile amax by redux.sync
//    (set_mla_kv_buffer_fp8_kernel);
//  - lanes kernel (e4m3 / e5m2, the fast kernel's alignment): one source vector per lane;
//  - generic kernel (any alignment): one warp per row, 16-bit loads, byte stores.
// A row whose slot is < 0, == skip_slot or >= num_slots is never written.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstring>

#include "jitkv/codes.h"
#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/src.cuh"
#include "jitkv/cuda/vec.cuh"
#include "mla/params.h"
#include "mla/rows.cuh"

namespace jitkv::mla {

using codes::DsMla;
using codes::KvFormat;
using codes::SrcDtype;

static_assert(DsMla::kNope % DsMla::kTile == 0 && DsMla::kScaleOffset >= DsMla::kNope &&
                  DsMla::kRopeOffset >= DsMla::kScaleOffset + 4 * DsMla::kTiles &&
                  DsMla::kBytes >= DsMla::kRopeOffset + 2 * DsMla::kRope,
              "fp8_ds_mla record parts overlap");

// A row as the fast fp8 kernel sees it: 16-byte source vectors of 8 values, kNopeBytes / 16 of k_nope
// then kRopeBytes / 16 of k_rope, taken by kRowWarps warps: warp w takes the w-th share of each part, its
// lane l the vectors l, l + 32, ... of that share.
template <int kNopeBytes, int kRopeBytes, int kRowWarps>
struct Fp8Row {
  static_assert(kNopeBytes % 16 == 0 && kRopeBytes % 16 == 0, "rows of 16-byte source vectors");
  static constexpr int kNopeShare = kNopeBytes / 16 / kRowWarps;
  static constexpr int kRopeShare = kRopeBytes / 16 / kRowWarps;
  static_assert(kNopeShare * kRowWarps * 16 == kNopeBytes && kRopeShare * kRowWarps * 16 == kRopeBytes,
                "each part splits evenly across the row's warps");
  static constexpr int kNopeIters = (kNopeShare + 31) / 32;
  static constexpr int kRopeIters = (kRopeShare + 31) / 32;

  // Whether a lane's register i holds a vector (compile-time true but for a last, partial one).
  __device__ __forceinline__ static bool nope_has(int i, int lane) {
    return 32 * i + 31 < kNopeShare || 32 * i + lane < kNopeShare;
  }
  __device__ __forceinline__ static bool rope_has(int i, int lane) {
    return 32 * i + 31 < kRopeShare || 32 * i + lane < kRopeShare;
  }
};

// A lane's fp8 bytes of its nope and rope vectors (8 per vector).
template <int kNope, int kRope>
struct Fp8Words {
  uint2 nope[kNope];
  uint2 rope[kRope > 0 ? kRope : 1];
};

// Rows can split across two warps when both parts halve into 16-byte vectors.
template <int kNopeBytes, int kRopeBytes>
constexpr bool fp8_row_splits() {
  return kNopeBytes % 32 == 0 && kRopeBytes % 32 == 0;
}

// Lane 0's store of its warp's tile scales (consecutive floats).
template <int kCount>
__device__ __forceinline__ void store_scales(char* dst, const float (&s)[kCount]) {
  if constexpr (kCount == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(s[0], s[1], s[2], s[3]);
  } else if constexpr (kCount == 2) {
    *reinterpret_cast<float2*>(dst) = make_float2(s[0], s[1]);
  } else {
#pragma unroll
    for (int t = 0; t < kCount; ++t) reinterpret_cast<float*>(dst)[t] = s[t];
  }
}

// Fast fp8 kernel (16-byte aligned sources; destination rows 8-byte aligned, 16 for fp8_ds_mla): the
// latency pattern of set_mla_kv_buffer_latency_kernel with kRowWarps warps per row. Addresses before
// the PDL wait; after it each warp issues its slot load, the per-tensor scale and all of its source
// loads at once (padding rows' sources are read, never written), lets the next kernel launch, quantizes,
// and stores if the slot is kept. No branch: the conversions of a lane's vectors form one block of
// straight-line code the scheduler interleaves (cuda::Divider). fp8_ds_mla: a tile's amax is a
// redux.sync max over the warp of the lanes' largest magnitudes (NaN left out, as vLLM's fmaxf does),
// its scale max(amax / 448, FLT_MIN) (cuda::amax_scale); lane 0 stores the warp's tile scales and the
// rope vectors are copied unchanged. Args: MlaFp8RowArgs, or MlaFp8Args for the calls it cannot hold.
template <KvFormat kFmt, SrcDtype kSrc, int kNopeBytes, int kRopeBytes, int kRowWarps, typename TLoc, typename Args>
__global__ void __launch_bounds__(32 * 8) set_mla_kv_buffer_fp8_kernel(const __grid_constant__ Args p) {
  using R = Fp8Row<kNopeBytes, kRopeBytes, kRowWarps>;
  constexpr bool kDs = kFmt == KvFormat::kDsMla;
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t row = warp / kRowWarps;
  const int share = static_cast<int>(warp % kRowWarps);
  cuda::warm_params(p, p.n);
  if (row >= p.n) return;
  const int nope_vec = share * R::kNopeShare + lane;  // index of this lane's first vector in its part
  const int rope_vec = share * R::kRopeShare + lane;
  const char* nope = p.nope + row * nope_stride(p) + nope_vec * 16;
  const char* rope = p.rope + row * rope_stride(p) + rope_vec * 16;
  cuda::pdl_wait();  // loc, the sources and a device scale may come from the previous kernel
  const int64_t slot = static_cast<int64_t>(cuda::load(static_cast<const TLoc*>(p.loc) + row));
  float scale = 0.0f;
  if constexpr (!kDs) scale = p.scale_ptr ? cuda::load(p.scale_ptr) : p.scale;
  uint4 vn[R::kNopeIters] = {};
  uint4 vr[R::kRopeIters > 0 ? R::kRopeIters : 1] = {};
#pragma unroll
  for (int i = 0; i < R::kNopeIters; ++i) {
    if (R::nope_has(i, lane)) vn[i] = cuda::load(reinterpret_cast<const uint4*>(nope) + 32 * i);
  }
#pragma unroll
  for (int i = 0; i < R::kRopeIters; ++i) {
    if (R::rope_has(i, lane)) vr[i] = cuda::load(reinterpret_cast<const uint4*>(rope) + 32 * i);
  }
  cuda::pdl_launch_dependents();

  using Words = Fp8Words<R::kNopeIters, kDs ? 0 : R::kRopeIters>;  // fp8_ds_mla copies its rope vectors
  Words q;
  constexpr int kVecsPerTile = kDs ? DsMla::kTile / 8 : 1;
  constexpr int kTilesPerReg = 32 / kVecsPerTile;  // a register row of the warp spans this many tiles
  constexpr int kWarpTiles = kDs ? R::kNopeShare / kVecsPerTile : 1;
  float tile_scale[kWarpTiles];
  if constexpr (kDs) {
    static_assert(kNopeBytes == 2 * DsMla::kNope && kRopeBytes == 2 * DsMla::kRope, "the fp8_ds_mla record's parts");
    static_assert(32 % kVecsPerTile == 0 && R::kNopeShare % 32 == 0, "whole tiles per register row");
    static_assert(DsMla::kScaleOffset % 16 == 0 && DsMla::kRopeOffset % 16 == 0, "16-byte aligned record parts");
    const int tile_in_reg = lane / kVecsPerTile;
    uint32_t part[kWarpTiles];
#pragma unroll
    for (int i = 0; i < R::kNopeIters; ++i) {
      const uint32_t a = cuda::vec_amax_no_nan<kSrc>(vn[i]);
#pragma unroll
      for (int h = 0; h < kTilesPerReg; ++h) part[i * kTilesPerReg + h] = tile_in_reg == h ? a : 0u;
    }
#pragma unroll
    for (int t = 0; t < kWarpTiles; ++t) {
      tile_scale[t] = cuda::amax_scale<kSrc>(__reduce_max_sync(0xffffffffu, part[t]), DsMla::kFP8Max);
    }
#pragma unroll
    for (int i = 0; i < R::kNopeIters; ++i) {
      float s = tile_scale[i * kTilesPerReg];
#pragma unroll
      for (int h = 1; h < kTilesPerReg; ++h) s = tile_in_reg == h ? tile_scale[i * kTilesPerReg + h] : s;
      q.nope[i] = cuda::quantize8<kSrc, kFmt>(vn[i], cuda::Divider(s));
    }
  } else {
    const cuda::Divider d(scale);
#pragma unroll
    for (int i = 0; i < R::kNopeIters; ++i) q.nope[i] = cuda::quantize8<kSrc, kFmt>(vn[i], d);
#pragma unroll
    for (int i = 0; i < R::kRopeIters; ++i) q.rope[i] = cuda::quantize8<kSrc, kFmt>(vr[i], d);
  }

  if (keeps(p, slot)) {
    char* dst = p.dst + slot * dst_stride(p);
#pragma unroll
    for (int i = 0; i < R::kNopeIters; ++i) {
      if (R::nope_has(i, lane)) reinterpret_cast<uint2*>(dst)[nope_vec + 32 * i] = q.nope[i];
    }
    if constexpr (kDs) {
      if (lane == 0) store_scales(dst + DsMla::kScaleOffset + 4 * kWarpTiles * share, tile_scale);
#pragma unroll
      for (int i = 0; i < R::kRopeIters; ++i) {
        if (R::rope_has(i, lane)) reinterpret_cast<uint4*>(dst + DsMla::kRopeOffset)[rope_vec + 32 * i] = vr[i];
      }
    } else {
#pragma unroll
      for (int i = 0; i < R::kRopeIters; ++i) {
        if (R::rope_has(i, lane)) reinterpret_cast<uint2*>(dst + kNopeBytes / 2)[rope_vec + 32 * i] = q.rope[i];
      }
    }
  }
}

// Lanes fp8 kernel (e4m3 / e5m2; the fast kernel's alignment): the copy latency kernel's layout with one
// 16-byte source vector per lane. Vector j of a row (k_nope's vectors, then k_rope's: RowShape) goes to
// lane j % 32 of the row's warp j / 32 (3 warps for 512+64 bf16), and its 8 fp8 bytes to byte 8 j of the
// destination row, where the quantized nope and rope lie back to back. A warp converts one vector per
// lane, half of split's chain. After the PDL wait every load goes out (slot, scale, source vector), the
// next kernel may launch, and the slot test comes right after that trigger: it ends the trigger's
// basic block. Without it ptxas schedules the scale's reciprocal ahead of the trigger, which then
// waits for the scale load (docs/performance.md "set_mla_kv_buffer_fp8_lanes_kernel"). Args:
// MlaFp8RowArgs, or MlaFp8Args for the calls it cannot hold.
template <KvFormat kFmt, SrcDtype kSrc, int kNopeBytes, int kRopeBytes, typename TLoc, typename Args>
__global__ void __launch_bounds__(32 * 8) set_mla_kv_buffer_fp8_lanes_kernel(const __grid_constant__ Args p) {
  using S = RowShape<kNopeBytes, kRopeBytes, 16>;
  static_assert(kFmt != KvFormat::kDsMla, "fp8_ds_mla records are not [nope | rope] fp8 bytes");
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t row = warp / S::kIters;
  const int j = static_cast<int>(warp % S::kIters) * 32 + (threadIdx.x & 31);
  cuda::warm_params(p, p.n);
  if (row >= p.n || j >= S::kVecs) return;
  const char* src = j < S::kNopeVecs ? p.nope + row * nope_stride(p) + 16 * j
                                     : p.rope + row * rope_stride(p) + 16 * (j - S::kNopeVecs);
  cuda::pdl_wait();  // loc, the sources and a device scale may come from the previous kernel
  const int64_t slot = static_cast<int64_t>(cuda::load(static_cast<const TLoc*>(p.loc) + row));
  const float scale = p.scale_ptr ? cuda::load(p.scale_ptr) : p.scale;
  const uint4 v = cuda::load(reinterpret_cast<const uint4*>(src));
  cuda::pdl_launch_dependents();  // after every load (see set_mla_kv_buffer_latency_kernel)
  if (!keeps(p, slot)) return;    // padding, skipped and out-of-range slots are never written
  reinterpret_cast<uint2*>(p.dst + slot * dst_stride(p))[j] = cuda::quantize8<kSrc, kFmt>(v, cuda::Divider(scale));
}

// Generic fp8 kernel (any alignment, any row length): one warp per row; the slot first, then 16-bit
// loads, __fdiv_rn per value and byte stores. fp8_ds_mla tile by tile: fmaxf over the lane's values
// (NaN left out), then a redux.sync max of the lanes' amax bits (non-negative floats order as their bits).
template <KvFormat kFmt, SrcDtype kSrc, int kNopeBytes, int kRopeBytes, typename TLoc>
__global__ void __launch_bounds__(32 * 8) set_mla_kv_buffer_fp8_generic_kernel(const __grid_constant__ MlaFp8Args p) {
  using T = cuda::SrcTraits<kSrc>;
  cuda::warm_params(p, p.n);
  cuda::pdl_wait();
  cuda::pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= p.n) return;
  const int64_t slot = static_cast<int64_t>(cuda::load(static_cast<const TLoc*>(p.loc) + row));
  if (!keeps(p, slot)) return;
  char* dst = p.dst + slot * p.dst_row_stride;
  const auto* nope = reinterpret_cast<const unsigned short*>(p.nope + row * p.nope_row_stride);
  const auto* rope = reinterpret_cast<const unsigned short*>(p.rope + row * p.rope_row_stride);
  if constexpr (kFmt == KvFormat::kDsMla) {
    static_assert(kNopeBytes == 2 * DsMla::kNope && kRopeBytes == 2 * DsMla::kRope, "the fp8_ds_mla record's parts");
    for (int t = 0; t < DsMla::kTiles; ++t) {
      const unsigned short* x = nope + t * DsMla::kTile;
      float amax = 0.0f;
      for (int k = lane; k < DsMla::kTile; k += 32) amax = fmaxf(amax, fabsf(T::value(cuda::load(x + k))));
      amax = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(amax)));
      const float s = fmaxf(__fdiv_rn(amax, DsMla::kFP8Max), FLT_MIN);
      if (lane == 0) memcpy(dst + DsMla::kScaleOffset + 4 * t, &s, sizeof(s));
      for (int k = lane; k < DsMla::kTile; k += 32) {
        dst[t * DsMla::kTile + k] = cuda::fp8_byte<kFmt>(__fdiv_rn(T::value(cuda::load(x + k)), s));
      }
    }
    const char* rope_bytes = reinterpret_cast<const char*>(rope);
    for (int k = lane; k < 2 * DsMla::kRope; k += 32) dst[DsMla::kRopeOffset + k] = rope_bytes[k];
  } else {
    const float s = p.scale_ptr ? cuda::load(p.scale_ptr) : p.scale;
    for (int k = lane; k < kNopeBytes / 2; k += 32) {
      dst[k] = cuda::fp8_byte<kFmt>(__fdiv_rn(T::value(cuda::load(nope + k)), s));
    }
    for (int k = lane; k < kRopeBytes / 2; k += 32) {
      dst[kNopeBytes / 2 + k] = cuda::fp8_byte<kFmt>(__fdiv_rn(T::value(cuda::load(rope + k)), s));
    }
  }
}

}  // namespace jitkv::mla
