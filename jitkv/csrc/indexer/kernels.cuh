// The indexer K cache's CUDA kernels (docs/design.md §5.1).
//
// Quantization of one token: amax = max |x| over its kHeadDim values, NaN elements ignored; scale =
// max(amax, kAmaxMin) / kFp8Max (a true fp32 division); "ue8m0" rounds the scale up to a power of two
// on its bits (exponent + 1 when the mantissa is not zero: exact, no log2); stored = e4m3(x / scale)
// with round-to-nearest-even and saturation to +-448, which is torch's clamp-then-convert.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "indexer/params.h"
#include "jitkv/codes.h"
#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/src.cuh"
#include "jitkv/cuda/vec.cuh"

namespace jitkv::indexer {

using codes::KvFormat;
using codes::SrcDtype;

constexpr int kGatherWarps = 4;  // warps per gather CTA; a warp takes 4 tokens, 8 lanes each
constexpr int kGatherLanes = 8;  // lanes per token: 16 bytes each
static_assert(kHeadDim == 16 * 8, "the writer maps a token's values to 16 lanes x 8 values");
static_assert(kHeadDim == kGatherLanes * 16, "the gather maps a token's bytes to 8 lanes x 16 bytes");

// The magnitude bits of the 2 halves of a word (bf16 or fp16), a NaN half counting as 0. A magnitude m
// is NaN iff m + kToSign reaches bit 15 (m > inf's magnitude); no carry crosses into the other half.
template <SrcDtype kSrc>
__device__ __forceinline__ uint32_t magnitude2(uint32_t w) {
  constexpr uint32_t kToSign = (0x7FFFu - cuda::SrcTraits<kSrc>::kInf) * 0x10001u;
  const uint32_t m = w & 0x7FFF7FFFu;
  const uint32_t nan = ((m + kToSign) & 0x80008000u) >> 15;  // 1 in the low bit of each NaN half
  return m & ~(nan * 0xFFFFu);
}

// Writer: half a warp per token, a grid of ceil(n / 2) warps. Lane l of a half holds values
// [8l, 8l + 8) (one 16-byte load; the half reads the row's 256 bytes in one coalesced request). After
// the PDL wait the slot load and the row load go out together (rows of padding tokens < n exist and are
// read, never written), the next kernel may launch, four xor-shuffles give the half its amax, and a
// kept token's 16 lanes store 8 bytes each (one 128-byte line) while lane 0 stores the scale.
template <SrcDtype kSrc, typename TIdx>
__global__ void __launch_bounds__(256) indexer_write_kernel(const __grid_constant__ WriteParams p) {
  cuda::warm_params(p, p.n);
  const int lane = threadIdx.x & 31, hl = lane & 15;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (2 * pair >= p.n) return;  // the whole warp: no shuffle is left waiting
  const int64_t token = 2 * pair + (lane >> 4);
  const bool real = token < p.n;  // false for the second half of the last warp when n is odd
  const char* src = p.k + token * p.k_row_stride + hl * 16;
  cuda::pdl_wait();  // k and slot_mapping may come from the previous kernel
  int64_t slot = -1;
  uint4 x = make_uint4(0u, 0u, 0u, 0u);
  if (real) {
    slot = static_cast<int64_t>(cuda::load(static_cast<const TIdx*>(p.slots) + token));
    x = cuda::load(reinterpret_cast<const uint4*>(src));
  }
  cuda::pdl_launch_dependents();  // after the loads, as set_mla_kv_buffer's latency kernel
  // Slot < 0 fails the unsigned range check; out-of-range slots are never written.
  const bool keep = static_cast<uint64_t>(slot) < static_cast<uint64_t>(p.num_slots);
  char* block = nullptr;
  int64_t row = 0;
  if (keep) {  // a 64-bit division while the row is in flight
    const int64_t blk = slot / p.block_size;
    row = slot - blk * p.block_size;
    block = p.cache + blk * p.block_stride;
    // The 4-byte scale store is a partial 32-byte sector: with the sector already in L2 it is
    // written back whole instead of merged in DRAM (docs/performance.md "scale-sector prefetch").
    if (hl == 0) asm volatile("prefetch.global.L2 [%0];" ::"l"(block + p.block_size * kHeadDim + row * kScaleBytes));
  }
  uint32_t m2 = __vmaxu2(__vmaxu2(magnitude2<kSrc>(x.x), magnitude2<kSrc>(x.y)),
                         __vmaxu2(magnitude2<kSrc>(x.z), magnitude2<kSrc>(x.w)));
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) m2 = __vmaxu2(m2, __shfl_xor_sync(0xFFFFFFFFu, m2, o));  // within the half
  const float amax = cuda::SrcTraits<kSrc>::value(max(m2 & 0xFFFFu, m2 >> 16));
  float scale = __fdiv_rn(fmaxf(amax, kAmaxMin), kFp8Max);
  if (p.ue8m0) scale = cuda::ue8m0_ceil(scale);
  if (!keep) return;
  // x / scale (ue8m0: x * 2^-e, the same exact quotient; __frcp_rn is exact for a power of two)
  constexpr KvFormat kE4M3 = KvFormat::kE4M3;
  constexpr cuda::QuantizeOrder kOrder = cuda::QuantizeOrder::kEachWord;
  const uint2 q = p.ue8m0 ? cuda::quantize8<kSrc, kE4M3, kOrder>(x, cuda::Pow2Divider{__frcp_rn(scale)})
                          : cuda::quantize8<kSrc, kE4M3, kOrder>(x, cuda::RnDivider{scale});
  *reinterpret_cast<uint2*>(block + row * kHeadDim + hl * 8) = q;
  if (hl == 0) *reinterpret_cast<float*>(block + p.block_size * kHeadDim + row * kScaleBytes) = scale;
}

// Gather: 8 lanes per token (16 bytes each), 4 tokens per warp, a grid sized from dst_k.shape[0]. Each
// lane finds its token's request (binary search over cu_seq_lens), the block-table entry and copies its
// 16 bytes; lane 0 of the 8 copies the scale. Zero bytes for an invalid block; rows no request covers
// are left alone.
__global__ void __launch_bounds__(kGatherWarps * 32) indexer_gather_kernel(const __grid_constant__ GatherParams p) {
  cuda::warm_params(p, p.num_tokens);
  const int lane = threadIdx.x & 31, sub = lane % kGatherLanes;
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * kGatherWarps + (threadIdx.x >> 5)) * (32 / kGatherLanes) +
                    lane / kGatherLanes;
  char* dst_k = p.dst_k + t * p.dst_k_stride + sub * 16;
  char* dst_scale = p.dst_scale + t * p.dst_scale_stride;
  cuda::pdl_wait();  // the cache, block table and cu_seq_lens may come from the previous kernel
  cuda::pdl_launch_dependents();
  if (t >= p.num_tokens) return;
  int64_t start;
  const int64_t b =
      request_of(t, p.batch, [&](int64_t i) { return static_cast<int64_t>(cuda::load(p.cu_seq_lens + i)); }, start);
  if (b < 0) return;
  const int64_t i = t - start, j = i / p.block_size;
  const int64_t phys =
      j < p.max_blocks ? static_cast<int64_t>(cuda::load(p.block_table + b * p.bt_row_stride + j)) : -1;
  uint4 data = make_uint4(0u, 0u, 0u, 0u);
  uint32_t scale = 0;
  if (phys >= 0 && phys < p.num_blocks) {
    const char* block = p.cache + phys * p.block_stride;
    const int64_t pos = i - j * p.block_size;
    data = cuda::load(reinterpret_cast<const uint4*>(block + pos * kHeadDim + sub * 16));
    if (sub == 0)
      scale = cuda::load(reinterpret_cast<const unsigned*>(block + p.block_size * kHeadDim + pos * kScaleBytes));
  }
  *reinterpret_cast<uint4*>(dst_k) = data;
  if (sub == 0) *reinterpret_cast<uint32_t*>(dst_scale) = scale;
}

}  // namespace jitkv::indexer
