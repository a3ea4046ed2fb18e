// transfer_pages' CUDA kernel: an SM copy of pages between pools in device memory or pinned host memory
// (params.h; the binding: transfer_pages_cuda.cu).
//
// The runs are the (pair i, layer l) of one pool pair: page src_pages[i] of layer l of src, at
// src.base + l * src.layer_stride + src_pages[i] * src.page_stride (bytes, 64-bit), copied to page
// dst_pages[i] of layer l of dst, page_bytes bytes; with num_pools 2 (a (K, V) tuple of one page size
// and layer count in one launch) the same for src2 / dst2.
// Pointers are device memory or pinned host memory: under UVA a pinned allocation's host address is
// valid on the device (the binding checks it), so one kernel serves host to device, device to host and
// device to device; loads and stores to host memory travel over the link.
//
// Work: chunks of kChunk vectors (32 lanes x kUnroll), a run cut into ceil(vectors / kChunk) of them,
// chunks numbered run by run, runs pair by pair (a page-first pool's layers of a page in order). A
// warp takes chunks c and c + warps of a grid-stride loop together: both chunks' ids, then every
// load of both, then the stores, so that each lane has 2 x kUnroll vectors in flight over the link
// (a read from host memory is a round trip of microseconds; bytes in flight, not instructions, set the
// rate). Chunks rather than whole runs per warp: a 128 KiB page (64 tokens of 8 x 128 bf16) is 64
// chunks spread over the grid instead of one warp's 64 round trips, and a 1152-byte page (an MLA
// token) is one chunk whose 72 vectors load at once (predicated) instead of in three dependent steps.
//
// Vectors of kVec bytes (16, 4 or 1), chosen on the host: 16 when every base, stride and page_bytes is
// a multiple of 16, else 4 when they are of 4, else 1 (odd page widths).
//
// Ids: from the id tensors in device memory, or (kInline > 0: ids that were on the host, resolved
// there) from the launch's parameter block, params.h InlineIds.
// Ids (docs/design.md §3): a pair with a negative id, or an id >= its pool's page count, is skipped
// (no host sync; JITKV_DEBUG=1 raises on the host first). Pairs naming one destination page race:
// the page gets bytes of their source pages in unspecified vectors (docs/design.md §2). Resolving
// them on the device costs a scan of the later ids per pair, O(n) each, which for thousands of
// 1-token pages costs more than their copy; engines never name a destination page twice in a call.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jitkv/codes.h"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/vec.cuh"
#include "transfer/params.h"

namespace jitkv::transfer {

constexpr int kWarps = 8;      // warps per CTA
constexpr int kCtasPerSm = 3;  // CTAs per SM of the max_sms the grid may use (85 registers a thread: no spills)
constexpr int kUnroll = 4;     // vectors per lane of a chunk
constexpr int kChunk = 32 * kUnroll;
constexpr int kLinkSms = codes::Transfer::kLinkSms;  // the default SM bound of a copy with a host pool
// Host ids: the pairs a launch's parameter block holds (codes.Transfer): 512 bytes, 8 KiB, 31.25 KiB.
constexpr int kInlineSmall = codes::Transfer::kInlinePairsSmall;
constexpr int kInlineMid = codes::Transfer::kInlinePairsMid;
constexpr int kInlinePairs = codes::Transfer::kInlinePairs;

__device__ __forceinline__ int64_t load_id(const void* p, int64_t i, bool i64) {
  return i64 ? cuda::load(static_cast<const int64_t*>(p) + i)
             : static_cast<int64_t>(cuda::load(static_cast<const int32_t*>(p) + i));
}

// Pair i's page ids: from the launch's own parameter block (kInline > 0: ids that were on the host,
// resolved there) or from the id tensors in device memory.
template <int kInline>
__device__ __forceinline__ void pair_ids(const TransferParams& p, const InlineIds<kInline>& ids, uint32_t i, int64_t& s,
                                         int64_t& d) {
  if constexpr (kInline > 0) {
    s = ids.src[i];
    d = ids.dst[i];
  } else {
    s = load_id(p.src_pages, i, p.src_i64);
    d = load_id(p.dst_pages, i, p.dst_i64);
  }
}

// One chunk of a warp: where its vectors come from and go, and how many of them this lane moves.
template <typename V>
struct Chunk {
  const V* from;
  V* to;
  int first;  // this lane's first vector index in the run; it moves first + 32 u for u < kUnroll
  int count;  // the run's vectors (0: nothing to move)
};

// Chunk c (32-bit: the binding refuses calls of 2^31 chunks or more, whose division would cost a
// 64-bit divide routine and its spills per chunk). Runs are numbered pair by pair, each pair's pools,
// each pool's layers.
template <typename V, int kInline>
__device__ __forceinline__ Chunk<V> locate(const TransferParams& p, const InlineIds<kInline>& ids, uint32_t c,
                                           uint32_t chunks, uint32_t per_run, uint32_t layers, int vectors, int lane) {
  Chunk<V> k{nullptr, nullptr, 0, 0};
  if (c >= chunks) return k;
  const uint32_t run = c / per_run;
  const uint32_t pair_pool = run / layers, layer = run - pair_pool * layers;
  const uint32_t i = p.num_pools == 2 ? pair_pool >> 1 : pair_pool;
  const bool second = p.num_pools == 2 && (pair_pool & 1u);
  const Pool& from = second ? p.src2 : p.src;
  const Pool& to = second ? p.dst2 : p.dst;
  int64_t s, d;
  pair_ids(p, ids, i, s, d);
  if (s < 0 || d < 0 || s >= from.num_pages || d >= to.num_pages) return k;
  k.from = reinterpret_cast<const V*>(from.at(layer, s));
  k.to = reinterpret_cast<V*>(to.at(layer, d));
  k.first = static_cast<int>(c - run * per_run) * kChunk + lane;
  k.count = vectors;
  return k;
}

// kCtasPerSm CTAs fit on one SM at once (the launch bound caps the registers at 85 per thread).
template <int kVec, int kInline>
__global__ void __launch_bounds__(kWarps * 32, kCtasPerSm)
    transfer_pages_kernel(const __grid_constant__ TransferParams p, const __grid_constant__ InlineIds<kInline> ids) {
  static_assert(kVec == 16 || kVec == 4 || kVec == 1, "vectors of 16, 4 or 1 bytes");
  using V = typename cuda::VecOf<kVec>::T;
  // The ids and the source pages may come from the previous kernel (a page just written, offloaded).
  cuda::pdl_wait();
  cuda::pdl_launch_dependents();
  if (p.n <= 0 || p.num_layers <= 0) return;
  const int lane = threadIdx.x & 31;
  const int vectors = static_cast<int>(p.page_bytes / kVec);
  const uint32_t per_run = static_cast<uint32_t>((vectors + kChunk - 1) / kChunk);
  const uint32_t layers = static_cast<uint32_t>(p.num_layers);
  const uint32_t chunks = static_cast<uint32_t>(p.n * p.num_pools) * layers * per_run;
  const uint32_t warps = gridDim.x * kWarps;
  for (uint32_t c = blockIdx.x * kWarps + (threadIdx.x >> 5); c < chunks; c += 2 * warps) {
    const Chunk<V> a = locate<V>(p, ids, c, chunks, per_run, layers, vectors, lane);
    const Chunk<V> b = locate<V>(p, ids, c + warps, chunks, per_run, layers, vectors, lane);
    V va[kUnroll], vb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (a.first + u * 32 < a.count) va[u] = cuda::load(a.from + a.first + u * 32);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (b.first + u * 32 < b.count) vb[u] = cuda::load(b.from + b.first + u * 32);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (a.first + u * 32 < a.count) a.to[a.first + u * 32] = va[u];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (b.first + u * 32 < b.count) b.to[b.first + u * 32] = vb[u];
    }
  }
}

}  // namespace jitkv::transfer
