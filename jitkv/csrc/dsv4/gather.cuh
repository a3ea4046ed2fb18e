// The DeepSeek-V4 FP8 K cache gather (dequantize_and_gather_k_cache; docs/design.md §5): one warp per
// token, kGatherTok tokens per warp and kGatherWarps warps per CTA, so one CTA covers a tile of
// consecutive positions of one request. Lane t resolves token t (block-table lookup once per token; for
// whole-sequence gathers it is issued together with the seq_lens load) and shuffles its address to the
// warp; the warp then issues the loads of all its tokens before converting any (kGatherTok x 584 B in
// flight per warp), converts e4m3 -> f16 -> f32, multiplies by the exact power-of-two scale and stores
// 16-byte bf16 vectors (jitkv/cuda/dequant.cuh). The grid is sized from R x out.shape[1] (graph-safe: no
// read of seq_lens on the host) but capped at kGatherWaves waves of resident CTAs; CTAs loop over tiles
// and jump past a request's tiles once they lie beyond its gather length, so an out buffer much longer
// than the gathers costs O(R) per CTA. Below the cap each CTA takes one tile and the hardware balances
// them (a 1-wave cap measured slower: docs/performance.md "DeepSeek-V4 launch constants"). Launched
// with programmatic dependent launch on SM90+ (jitkv/cuda/launch.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/params.h"
#include "jitkv/cuda/dequant.cuh"
#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/vec.cuh"
#include "jitkv/cuda/warp.cuh"

namespace jitkv::dsv4 {

// Block-table entry of position pos of request r, or -1 when pred is false or the position lies past
// the table. Issued as a load that the caller need not wait for yet.
__device__ __forceinline__ int32_t lookup_block(const GatherParams& p, int64_t r, int64_t pos, bool pred) {
  pred = pred && pos >= 0 && pos <= INT32_MAX;
  const uint32_t blk = pred ? static_cast<uint32_t>(pos) / static_cast<uint32_t>(p.block_size) : 0u;
  return cuda::load_or(p.block_table + r * p.bt_stride + blk, pred && blk < p.max_blocks, -1);
}

// One tile: tokens i = first + t * kGatherWarps (t < kGatherTok) of request r for this warp, at
// positions start + i; rows i >= limit are not written. Lane t resolves token t; phys is its
// block-table entry if have_phys (whole-sequence gathers look it up early).
__device__ __forceinline__ void gather_tokens(const GatherParams& p, int64_t r, int64_t first, int64_t start,
                                              int64_t limit, int32_t phys, bool have_phys, int lane) {
  const int64_t i = first + lane * kGatherWarps;
  const bool write = lane < kGatherTok && i < limit;
  const int64_t pos = start + i;  // < seq_len <= INT32_MAX when written
  if (!have_phys) phys = lookup_block(p, r, pos, write);
  int64_t base = -1;  // byte offset of the token's block; -1: zero row
  int row = 0;
  if (write && phys >= 0 && phys < p.num_blocks) {
    base = phys * p.block_stride;
    row = static_cast<int>(static_cast<uint32_t>(pos) % static_cast<uint32_t>(p.block_size));
  }
  const uint32_t write_mask = __ballot_sync(cuda::kFullWarp, write);
  if (write_mask == 0) return;

  uint2 a[kGatherTok], sc[kGatherTok];
  uint4 b[kGatherTok];
#pragma unroll
  for (int t = 0; t < kGatherTok; ++t) {  // every load of the warp in flight before the first use
    const int64_t bt = cuda::shfl64(base, t);
    const int rt = __shfl_sync(cuda::kFullWarp, row, t);
    const bool ld = bt >= 0;
    const uint8_t* blk = p.cache + (ld ? bt : 0);
    const uint8_t* data = blk + int64_t(rt) * kDataBytes;
    a[t] = cuda::load_no_l1_v2(data + 8 * lane, ld);
    const uint2 nope = cuda::load_no_l1_v2(data + 256 + 8 * lane, ld && lane < 24);
    b[t] = cuda::load_no_l1_v4(data + kNopeBytes + 16 * (lane - 24), ld && lane >= 24);
    if (lane < 24) b[t] = make_uint4(nope.x, nope.y, 0u, 0u);
    sc[t] = cuda::load_no_l1_v2(blk + scale_offset(p.block_size) + rt * kScaleBytes, ld);
  }
  const int g = lane >> 3;
#pragma unroll
  for (int t = 0; t < kGatherTok; ++t) {
    if (!((write_mask >> t) & 1u)) continue;
    const int64_t it = first + t * kGatherWarps;
    uint16_t* orow = p.out + r * p.out_s0 + (p.offset + it) * p.out_s1;
    // e4m3 times a power of two: exact unless the scale leaves the bf16 range
    const uint4 oa = cuda::dequant8<false>(a[t].x, a[t].y, cuda::ue8m0_scale((sc[t].x >> (8 * g)) & 0xFFu));
    const uint4 ob =
        lane < 24 ? cuda::dequant8<false>(b[t].x, b[t].y, cuda::ue8m0_scale((sc[t].y >> (8 * g)) & 0xFFu)) : b[t];
    *reinterpret_cast<uint4*>(orow + 8 * lane) = oa;        // plain stores: the attention kernel reads
    *reinterpret_cast<uint4*>(orow + 256 + 8 * lane) = ob;  // these rows next, from L2 if they stay
  }
}

__global__ void __launch_bounds__(kGatherWarps * 32, kGatherMinCtas)
    dsv4_gather_kernel(const __grid_constant__ GatherParams p) {
  jitkv::cuda::warm_params(p, p.rows);
  jitkv::cuda::pdl_wait();  // the cache, seq_lens and block table may come from the previous kernel
  jitkv::cuda::pdl_launch_dependents();
  constexpr int kTile = kGatherWarps * kGatherTok;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool whole = p.gather_lens == nullptr;
  const int64_t grid = gridDim.x;
  int64_t tile = blockIdx.x;
  while (tile < p.num_tiles) {
    const int64_t r = tile / p.tiles_per_req;
    const int64_t i0 = (tile - r * p.tiles_per_req) * kTile;
    const int64_t first = i0 + warp;
    // A whole-sequence gather has position == row index: its block-table lookup goes out together
    // with the seq_lens load instead of after it (one memory latency less per tile).
    const int32_t phys = whole ? lookup_block(p, r, first + lane * kGatherWarps,
                                              lane < kGatherTok && first + lane * kGatherWarps < p.rows)
                               : -1;
    const int64_t seq = cuda::load_or(p.seq_lens + r, true, 0);
    const int64_t gl = whole ? seq : cuda::load_or(p.gather_lens + r, true, 0);
    const int64_t limit = min(gl, p.rows);
    if (i0 >= limit) {  // this and later tiles of r are empty: first tile of r + 1 that is ours
      const int64_t next = (r + 1) * p.tiles_per_req;
      tile = next + ((static_cast<int64_t>(blockIdx.x) - next) % grid + grid) % grid;
      continue;
    }
    gather_tokens(p, r, first, seq - gl, limit, phys, whole, lane);
    tile += grid;
  }
}

}  // namespace jitkv::dsv4
