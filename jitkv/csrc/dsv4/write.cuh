// The DeepSeek-V4 FP8 K cache writer (quantize_and_insert_k_cache; docs/design.md §5): one warp per
// token, kWriteTok tokens per warp. Lane l holds dims [8l, 8l+8) and [256+8l, 256+8l+8) (two coalesced
// 16-byte loads), so each 64-dim group lives in 8 lanes and its amax needs 3 xor-shuffles (both groups
// of a lane packed in one word). The UE8M0 exponent comes from the float bits of max(amax, 1e-4)
// (exact, no log2), the scale is a power of two, so x * 2^-e is exact and one round-to-nearest satfinite
// conversion gives the e4m3 byte torch would give (jitkv/cuda/fp8.cuh). Slots are read first; slot < 0
// or past the cache skips the token before its row is written. The 8 scale bytes go out as one 8-byte
// store, into a 32-byte sector the warp prefetched into L2 as soon as the slot was known. Launched with
// programmatic dependent launch on SM90+ (jitkv/cuda/launch.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/params.h"
#include "jitkv/codes.h"
#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/vec.cuh"
#include "jitkv/cuda/warp.cuh"

namespace jitkv::dsv4 {

using codes::KvFormat;
using codes::SrcDtype;

constexpr uint32_t kMinAmaxBits = 0x38D1B717u;  // bits of 1e-4f
constexpr uint32_t kNoScaleExp = 128;           // exponent of a group whose amax is inf or NaN

// e = smallest integer with 448 * 2^e >= m, m = max(amax, 1e-4) given as bf16 magnitude bits. With
// m = 1.f * 2^(E-127) (float bits E, f), 448 = 1.75 * 2^8 gives e = E - 135 + (1.f > 1.75). Finite bf16
// amax keeps e in [-22, 120]; inf or NaN gives 128 (byte 255, the UE8M0 NaN code).
__device__ __forceinline__ uint32_t ue8m0_exponent_biased(uint32_t amax16) {
  const uint32_t m = max(amax16 << 16, kMinAmaxBits);  // integer max == float max here, NaN largest
  const uint32_t be = m >> 23;
  if (be == 255) return kNoScaleExp + 127;
  return be - 8 + ((m & 0x7FFFFFu) > 0x600000u);  // (E - 135 + carry) + 127
}

// Max |x| over 8 bf16 as magnitude bits (integer max: NaN > inf > finite, so NaN propagates).
__device__ __forceinline__ uint32_t absmax8(uint4 v) {
  constexpr uint32_t kMag = 0x7FFF7FFFu;
  const uint32_t m = __vmaxu2(__vmaxu2(v.x & kMag, v.y & kMag), __vmaxu2(v.z & kMag, v.w & kMag));
  return max(m & 0xFFFFu, m >> 16);
}

// e4m3 NaN keeps the sign of the bf16 NaN (as torch's conversion does); the scaled product may not.
__device__ __noinline__ uint2 fix_nan8(uint4 x, uint2 q) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[2] = {q.x, q.y};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t h = (w[j / 2] >> (16 * (j % 2))) & 0xFFFFu;
    if ((h & 0x7FFFu) > 0x7F80u) {
      const int sh = 8 * (j % 4);
      out[j / 4] = (out[j / 4] & ~(0xFFu << sh)) | ((0x7Fu | ((h >> 8) & 0x80u)) << sh);
    }
  }
  return make_uint2(out[0], out[1]);
}

// 8 bf16 -> 8 e4m3 bytes with the group's biased exponent b: x * 2^-e is exact, so one conversion
// gives the e4m3 byte torch would give.
__device__ __forceinline__ uint2 quant8(uint4 x, uint32_t b, bool has_nan) {
  constexpr cuda::QuantizeOrder kOrder = cuda::QuantizeOrder::kEachWordHighFirst;
  uint2 q = cuda::quantize8<SrcDtype::kBF16, KvFormat::kE4M3, kOrder>(x, cuda::Pow2Divider{cuda::ue8m0_inverse(b)});
  if (has_nan) q = fix_nan8(x, q);
  return q;
}

// One token: xa = dims [8l, 8l+8), xb = dims [256+8l, 256+8l+8) of lane l.
__device__ __forceinline__ void quantize_token(uint4 xa, uint4 xb, uint8_t* dst, uint8_t* dst_scale, int lane) {
  uint32_t amax = absmax8(xa) | (absmax8(xb) << 16);  // groups lane/8 and 4 + lane/8 (or rope)
#pragma unroll
  for (int s = 1; s < 8; s <<= 1) amax = __vmaxu2(amax, __shfl_xor_sync(cuda::kFullWarp, amax, s));
  const uint32_t amax_a = amax & 0xFFFFu, amax_b = amax >> 16;
  const uint32_t ba = ue8m0_exponent_biased(amax_a), bb = ue8m0_exponent_biased(amax_b);

  *reinterpret_cast<uint2*>(dst + 8 * lane) = quant8(xa, ba, amax_a > 0x7F80u);
  if (lane < 24) {
    *reinterpret_cast<uint2*>(dst + 256 + 8 * lane) = quant8(xb, bb, amax_b > 0x7F80u);
  } else {  // dims 448..511: bf16 bytes as they are
    *reinterpret_cast<uint4*>(dst + kNopeBytes + 16 * (lane - 24)) = xb;
  }
  // The 8 scale bytes as one store (one partial-sector write, not two): group g's byte sits in lane 8g.
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    lo |= __shfl_sync(cuda::kFullWarp, ba, 8 * g) << (8 * g);
    if (g < 3) hi |= __shfl_sync(cuda::kFullWarp, bb, 8 * g) << (8 * g);  // byte 7 stays 0
  }
  if (lane == 0) *reinterpret_cast<uint2*>(dst_scale) = make_uint2(lo, hi);
}

template <typename IdxT>
__global__ void __launch_bounds__(kWriteWarps * 32) dsv4_quant_insert_kernel(const __grid_constant__ WriteParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * kWriteTok;
  // Addresses first (they read only the parameter block), pinned ahead of warm_params' branch: else the
  // compiler computes them after the wait, between the wait and the loads.
  const bool has_slot = lane < kWriteTok && first + lane < p.n;
  const IdxT* slot_at = static_cast<const IdxT*>(p.slots) + first + lane;
  const uint16_t* src[kWriteTok];
#pragma unroll
  for (int t = 0; t < kWriteTok; ++t) {
    src[t] = p.k + (first + t) * p.k_stride + 8 * lane;
    asm volatile("" : "+l"(src[t]));
  }
  asm volatile("" : "+l"(slot_at));
  jitkv::cuda::warm_params(p, p.n);
  jitkv::cuda::pdl_wait();  // k and the slots may come from the previous kernel

  // Lane t < kWriteTok loads the slot of token first + t (-1: skip the token). The rows of every
  // token < n are loaded at the same time (padding rows' sources exist; they are never written): one
  // memory round trip from the PDL wait to the first conversion.
  int64_t slot = -1;
  if (has_slot) {
    const int64_t s = static_cast<int64_t>(cuda::load(slot_at));
    if (s >= 0 && s < p.num_slots) slot = s;
  }
  uint4 xa[kWriteTok], xb[kWriteTok];
#pragma unroll
  for (int t = 0; t < kWriteTok; ++t) {  // all rows in flight before the first conversion
    const bool real = first + t < p.n;
    xa[t] = cuda::load_no_l1_v4(src[t], real);
    xb[t] = cuda::load_no_l1_v4(src[t] + 256, real);
  }
  jitkv::cuda::pdl_launch_dependents();  // after the loads (as mla/copy.cuh's latency kernel)
  // Block and row (a 64-bit division) while the rows are in flight, not before their loads.
  int64_t base = -1;
  int row = 0;
  if (slot >= 0) {
    const int64_t blk = slot / p.block_size;
    base = blk * p.block_stride;
    row = static_cast<int>(slot - blk * p.block_size);
    // The 8-byte scale write is a partial 32-byte sector: with the sector already in L2 it is
    // written back whole, instead of as a masked write the memory controller must merge
    // (read-modify-write in DRAM; docs/performance.md "scale-sector prefetch").
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p.cache + base + scale_offset(p.block_size) + row * kScaleBytes));
  }
#pragma unroll
  for (int t = 0; t < kWriteTok; ++t) {
    const int64_t bt = cuda::shfl64(base, t);
    const int rt = __shfl_sync(cuda::kFullWarp, row, t);
    if (bt < 0) continue;
    uint8_t* blk = p.cache + bt;
    quantize_token(xa[t], xb[t], blk + int64_t(rt) * kDataBytes, blk + scale_offset(p.block_size) + rt * kScaleBytes,
                   lane);
  }
}

}  // namespace jitkv::dsv4
