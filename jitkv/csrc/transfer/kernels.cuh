// transfer_pages' CUDA kernel: an SM copy of pages between pools in device memory or pinned host memory
// (params.h; the binding: transfer_pages_cuda.cu).
//
// The runs are the (pair i, layer l) of one pool pair: page src_pages[i] of layer l of src, at
// src.base + l * src.layer_stride + src_pages[i] * src.page_stride (bytes, 64-bit), copied to page
// dst_pages[i] of layer l of dst, page_bytes bytes. (A tuple of pools is one launch per pool pair.)
// A work item is a pair and one of `groups` interleaved sets of its layers (layers g, g + groups, ...):
// groups = min(num_layers, ceil(kItemsPerWarp * warps / n)), so that there are about kItemsPerWarp
// items per warp (the grid-stride loop stays balanced) while the pair's ids and its duplicate scan
// (below) are read once per item, not once per layer: with many pairs, one item per pair.
// Pointers are device memory or pinned host memory: under UVA a pinned allocation's host address is
// valid on the device (the binding checks it), so one kernel serves host to device, device to host and
// device to device; loads and stores to host memory travel over the link.
//
// A warp per work item, not a CTA: a page of one layer is 1 to a few tens of KiB (an MLA page of 16
// tokens x 576 bf16 is 18 KiB, a token-sized page 1152 bytes, fewer than a 128-thread CTA's 16-byte
// vectors), so warps that each take whole items in a grid-stride loop stay busy with no __syncthreads
// and no idle threads on small pages. Each lane moves vectors lane, lane + 32, ... of the run, kUnroll
// loads issued before their stores so that several link round trips are in flight per lane.
//
// Vectors of kVec bytes (16, 4 or 1), chosen on the host: 16 when every base, stride and page_bytes is
// a multiple of 16, else 4 when they are of 4, else 1 (odd page widths).
//
// Ids (docs/design.md §3): a pair with a negative id, or an id >= its pool's page count, is skipped
// (no host sync; JITKV_DEBUG=1 raises on the host first). Pairs naming one destination page: the last
// valid pair wins, as the CPU kernel and the torch reference: a warp skips its pair when a later valid
// pair names the same destination page (a warp-wide scan of the later ids, 32 per step; they stay in
// L1/L2; about n / 64 steps per item, n * groups items). This keeps every destination page one source
// page whole, never a mix of racing warps.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/vec.cuh"
#include "transfer/params.h"

namespace jitkv::transfer {

constexpr int kWarps = 8;         // warps per CTA
constexpr int kCtasPerSm = 4;     // CTAs per SM of the max_sms the grid may use
constexpr int kUnroll = 4;        // vectors in flight per lane
constexpr int kItemsPerWarp = 8;  // work items per warp the layer groups aim at

__device__ __forceinline__ int64_t load_id(const void* p, int64_t i, bool i64) {
  return i64 ? cuda::load(static_cast<const int64_t*>(p) + i)
             : static_cast<int64_t>(cuda::load(static_cast<const int32_t*>(p) + i));
}

// Whether a pair after i (j in (i, n)) with valid ids names destination page d (d itself valid).
// Warp-uniform: every lane of the warp calls it with the same i and d.
__device__ __forceinline__ bool superseded(const TransferParams& p, int64_t i, int64_t d, int lane) {
  for (int64_t base = i + 1; base < p.n; base += 32) {
    const int64_t j = base + lane;
    bool hit = false;
    if (j < p.n && load_id(p.dst_pages, j, p.dst_i64) == d) {
      const int64_t s = load_id(p.src_pages, j, p.src_i64);
      hit = s >= 0 && s < p.src.num_pages;
    }
    if (__any_sync(0xffffffffu, hit)) return true;
  }
  return false;
}

// One page run: page_bytes / kVec vectors, lane k moving vectors k, k + 32, ...
template <int kVec>
__device__ __forceinline__ void copy_run(char* to, const char* from, int64_t page_bytes, int lane) {
  using V = typename cuda::VecOf<kVec>::T;
  const V* src = reinterpret_cast<const V*>(from);
  V* dst = reinterpret_cast<V*>(to);
  const int64_t nvec = page_bytes / kVec;
  int64_t k = lane;
  for (; k + (kUnroll - 1) * 32 < nvec; k += kUnroll * 32) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = cuda::load(src + k + u * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[k + u * 32] = v[u];
  }
  for (; k < nvec; k += 32) dst[k] = cuda::load(src + k);
}

// kCtasPerSm CTAs fit on one SM at once (the launch bound caps the registers at 64 per thread).
template <int kVec>
__global__ void __launch_bounds__(kWarps * 32, kCtasPerSm)
    transfer_pages_kernel(const __grid_constant__ TransferParams p) {
  static_assert(kVec == 16 || kVec == 4 || kVec == 1, "vectors of 16, 4 or 1 bytes");
  // The ids and the source pages may come from the previous kernel (a page just written, offloaded).
  cuda::pdl_wait();
  cuda::pdl_launch_dependents();
  if (p.n <= 0 || p.num_layers <= 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps;  // warps in the grid
  const int64_t want = (kItemsPerWarp * step + p.n - 1) / p.n;    // layer groups per pair
  const int64_t groups = want < 1 ? 1 : (want > p.num_layers ? p.num_layers : want);
  const int64_t items = p.n * groups;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); w < items; w += step) {
    const int64_t i = w / groups;
    const int64_t s = load_id(p.src_pages, i, p.src_i64);
    const int64_t d = load_id(p.dst_pages, i, p.dst_i64);
    if (s < 0 || d < 0 || s >= p.src.num_pages || d >= p.dst.num_pages) continue;
    if (superseded(p, i, d, lane)) continue;
    for (int64_t layer = w - i * groups; layer < p.num_layers; layer += groups) {
      const char* from = p.src.base + layer * p.src.layer_stride + s * p.src.page_stride;
      char* to = p.dst.base + layer * p.dst.layer_stride + d * p.dst.page_stride;
      copy_run<kVec>(to, from, p.page_bytes, lane);
    }
  }
}

}  // namespace jitkv::transfer
