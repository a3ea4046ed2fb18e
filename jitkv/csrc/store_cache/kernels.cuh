// store_cache's latency and bulk kernels (the row kernels: row.cuh).
//
// Algorithm. A token's K row (and V row) is cut into chunks of 32 * kUnroll destination vectors of
// kVec bytes (kVec = 16 in specialised builds). One warp owns one (token, chunk): it reads the slot,
// applies skip_slot / loc_map, issues every load of its K and V chunk (lane i takes vectors i, i+32,
// ...), then every store. Vector i of a row lies in head i / head_vecs at byte (i % head_vecs) * kVec
// of that head, so dense rows and per-head strided layouts (HND caches, fused-qkv source views) share
// one code path; every stride is in bytes.
//
// Two kernels per build (this file), and the latency kernel's compact row form (row.cuh). The latency
// kernel: one vector per lane and side, every address computed before the PDL wait, the slot and the
// source loads issued together after it (padding rows' sources are read, never written), and (fp8) K
// and V in separate warps, so a lone warp's chain from slot to store is a few dozen instructions.
// Beyond kLatencyWarpsPerSM warps per SM (store_cache_cuda.cu) the bulk kernel: 2 KB of source per warp
// and side (H=8 x D=128 bf16 rows are one chunk per token, larger rows split across warps, grid.y =
// chunks per token), few registers, the slot first so that skipped rows cost no reads.
//
// Per-head scales: a lane's vector lies in one head (head bytes are multiples of the vector width), so
// each lane divides by the scale of its vector's head: its offset is computed with the addresses, the
// scale loaded where the shared one was. The row kernels take contiguous per-head scales through their
// scale word (RowFp8Args); the latency and bulk kernels have per-head forms (kPerHead, fp8 builds) for
// the other calls, and their one-scale forms are compiled without any of it.
// python -m jitkv.benchmark --op store_cache has the "fp8 e4m3 per-head" rows (docs/performance.md
// "RowFp8Args").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "jitkv/codes.h"
#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/paged.cuh"
#include "jitkv/cuda/vec.cuh"
#include "store_cache/convert.cuh"
#include "store_cache/params.h"

namespace jitkv::store_cache {

using cuda::load_index;

// ---- one side (K or V) of one chunk ----
// prepare() does everything that does not depend on the slot (vector offsets in the source and
// destination rows, the fp8 scale and its reciprocal); load() and store() then only add offsets to
// two row pointers. kPin (latency kernels) keeps prepare()'s work before the kernel's padding check,
// where it runs while the slot load is in flight: otherwise the compiler sinks it to its first use,
// after the slot, and a lone warp at a few cycles per instruction puts ~400 instructions on the
// latency of an n = 1 write. Bulk kernels leave it sunk (fewer live registers, more warps per SM).
// kHeadBytes: destination bytes per head when compiled in, 0 when taken from Side::head_vecs.
// kPerHead: vector u divides by the scale of its own head (else one scale for the side).
template <int kHeadBytes, int kVec, class Cv, bool kPin, bool kPerHead>
struct SideChunk {
  static constexpr int kSrcVec = kVec * Cv::kRatio;
  static constexpr int kUnroll = Cv::kUnroll;
  static constexpr int kScales = kPerHead ? kUnroll : 1;
  static_assert(kHeadBytes % kVec == 0, "head bytes must be a multiple of the vector width");
  static_assert(!kPerHead || Cv::kQuant, "per-head scales are fp8's");

  Pack<kSrcVec> data[kUnroll];
  uint64_t src_addr[kUnroll];  // this lane's source vectors
  int64_t dst_off[kUnroll];    // and their byte offsets in the destination row
  int32_t count;               // vectors u < count lie in the row (after load(): are written)
  int64_t scale_off[kScales];  // per-head scales: element offset of vector u's head's scale
  cuda::Divider div[kScales];  // fp8 only

  __device__ __forceinline__ static uint32_t head_vecs(const Side& s) {
    return kHeadBytes ? uint32_t(kHeadBytes / kVec) : uint32_t(s.head_vecs);
  }

  // Byte offset in its row of vector i (of vec_bytes bytes): head i / hv, heads head_stride apart.
  __device__ __forceinline__ static int64_t vec_offset(uint32_t i, uint32_t hv, int64_t head_stride, int vec_bytes) {
    const uint32_t h = i / hv;
    return int64_t(h) * head_stride + int64_t(i - h * hv) * vec_bytes;
  }

  // Addresses only (no memory access): latency kernels call it before the PDL wait.
  __device__ __forceinline__ void prepare(const Side& s, int64_t token, uint32_t first) {
    const uint32_t hv = head_vecs(s), row_vecs = uint32_t(s.row_vecs);
    const uint64_t src_row = reinterpret_cast<uint64_t>(s.src) + token * s.src_stride_token;
    count = first < row_vecs ? min(kUnroll, int32_t((row_vecs - first + 31) / 32)) : 0;
    if constexpr (kPin) asm volatile("" : "+r"(count));
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = first + 32 * u;
      src_addr[u] = src_row + vec_offset(i, hv, s.src_stride_head, kSrcVec);
      dst_off[u] = vec_offset(i, hv, s.dst_stride_head, kVec);
      if constexpr (kPin) asm volatile("" : "+l"(src_addr[u]), "+l"(dst_off[u]));
      if constexpr (kPerHead) {
        scale_off[u] = int64_t(i / hv) * s.scale_stride;
        if constexpr (kPin) asm volatile("" : "+l"(scale_off[u]));
      }
    }
  }

  // fp8: the scale (a device scale may come from the previous kernel: after the PDL wait). Per head,
  // a vector past the row (u >= count) reads none.
  __device__ __forceinline__ void load_scale(const Side& s) {
    if constexpr (kPerHead) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        div[u] = cuda::Divider(s.scale_ptr != nullptr && u < count ? cuda::load(s.scale_ptr + scale_off[u]) : s.scale);
    } else if constexpr (Cv::kQuant) {
      div[0] = cuda::Divider(s.scale_ptr ? cuda::load(s.scale_ptr) : s.scale);
    }
  }

  __device__ __forceinline__ void load(bool ok) {
    if (!ok) count = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u < count) data[u] = cuda::load_pack<kSrcVec>(reinterpret_cast<const char*>(src_addr[u]));
  }

  __device__ __forceinline__ void store(char* row) const {
    if (count == 0) return;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u < count) cuda::store_pack<kVec>(row + dst_off[u], Cv::template run<kVec>(data[u], div[kPerHead ? u : 0]));
  }
};

// A side's cache in registers (jitkv/cuda/paged.cuh): a slot's row is dst + slot * dst_stride_token +
// (slot / block_size) * block_adj. constexpr: the binding computes block_adj too.
constexpr int64_t block_adj(const Side& s) {
  return cuda::block_adj(s.dst_stride_block, s.block_size, s.dst_stride_token);
}

__device__ __forceinline__ cuda::PagedRows paged_rows(const Side& s) {
  return cuda::PagedRows{s.dst, s.dst_stride_token, block_adj(s), s.block_magic, s.block_shift};
}

// Byte address of `slot`'s row in one cache (slot in [0, num_slots)).
__device__ __forceinline__ char* slot_row(const Side& s, int64_t slot) {
  const cuda::PagedRows d = paged_rows(s);
  return d.row(slot, d.block(slot));
}

// Destination slot of a slot_mapping entry, or -1 when the row is skipped (padding, skip_slot, outside
// loc_map or mapped below 0; skip_slot is compared before the translation).
__device__ __forceinline__ int64_t resolve_slot(const StoreCacheArgs& p, int64_t slot) {
  if (slot < 0 || slot == p.skip_slot) return -1;
  if (p.loc_map == nullptr) return slot;
  if (slot >= p.loc_map_size) return -1;  // never read out of bounds
  return load_index(p.loc_map, p.loc_i64, slot);
}

// A token's slot_mapping entry: loaded after the PDL wait, value() after the trigger.
struct SlotMappingEntry {
  int64_t entry;
  __device__ __forceinline__ SlotMappingEntry(const StoreCacheArgs& p, int64_t t)
      : entry(load_index(p.slots, p.slot_i64, t)) {}
  __device__ __forceinline__ int64_t value(const StoreCacheArgs&) const { return entry; }
};

// The latency and bulk kernels' slot source: slot_mapping, or in a page-table build (kTable) the
// token's table entries (cuda::TableSlot).
template <bool kTable>
using SlotEntry = std::conditional_t<kTable, cuda::TableSlot, SlotMappingEntry>;

// Latency kernel: one vector per lane and side. Addresses are computed before the PDL wait (they
// read only the parameter block); after it a warp issues the slot load and its source loads together
// (every token < n has source rows, padding included, so reading them is safe; they are written only
// for a kept slot), lets the next kernel launch, then resolves the slot and stores.
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcDtype kSrc, KvFormat kFmt, bool kPerHead, bool kTable>
__device__ __forceinline__ void latency_write(const ArgsOf<kTable>& p) {
  using Cv = Convert<kSrc, kFmt, false>;
  cuda::warm_params(p, p.n);
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const uint32_t first = blockIdx.y * 32 + (threadIdx.x & 31);
  constexpr bool kSplit = split_sides(kFmt, kKHeadBytes, kVHeadBytes, false);
  // With split sides (grid.z = 2) blockIdx.z picks K or V: one code path with the side picked by
  // data (with two, the compiler computes both).
  const Side& first_side = kSplit && blockIdx.z ? p.v : p.k;
  SideChunk<kKHeadBytes, kVec, Cv, true, kPerHead> k;
  SideChunk<kVHeadBytes, kVec, Cv, true, kPerHead> v;
  k.prepare(first_side, token, first);
  if constexpr (!kSplit) v.prepare(p.v, token, first);
  if (token >= p.n) return;
  cuda::pdl_wait();  // sources, indices and device scales may come from the previous kernel
  const SlotEntry<kTable> slot_entry(p, token);
  k.load(true);
  if constexpr (!kSplit) v.load(true);
  cuda::pdl_launch_dependents();  // after the loads (as mla/copy.cuh's latency kernel)
  k.load_scale(first_side);
  if constexpr (!kSplit) v.load_scale(p.v);
  const int64_t entry = slot_entry.value(p);
  int64_t slot = entry;
  if (p.loc_map != nullptr)
    slot = resolve_slot(p, entry);
  else if (entry == p.skip_slot)
    return;  // padding (< 0) fails the unsigned range check below
  // Padding, skipped and out-of-range slots are never written (K and V have the same slot count).
  if (uint64_t(slot) >= uint64_t(p.k.num_slots)) return;
  const cuda::PagedRows dk = paged_rows(first_side);
  uint64_t blk = dk.block(slot);
  k.store(dk.row(slot, blk));
  if constexpr (!kSplit) {
    const cuda::PagedRows dv = paged_rows(p.v);
    if (p.same_blocks == 0) blk = dv.block(slot);
    v.store(dv.row(slot, blk));
  }
}

// Bulk kernel: the slot first, then a padding or out-of-range row is dropped before anything of it
// is read (at large n every skipped row saves its bytes).
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcDtype kSrc, KvFormat kFmt, bool kPerHead, bool kTable>
__device__ __forceinline__ void bulk_write(const ArgsOf<kTable>& p) {
  using Cv = Convert<kSrc, kFmt, true>;
  cuda::pdl_wait();  // sources and indices may come from the previous kernel
  cuda::pdl_launch_dependents();
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (token >= p.n) return;
  const int64_t entry = SlotEntry<kTable>(p, token).value(p);
  const uint32_t first = blockIdx.y * (32 * Cv::kUnroll) + (threadIdx.x & 31);
  SideChunk<kKHeadBytes, kVec, Cv, false, kPerHead> k;
  SideChunk<kVHeadBytes, kVec, Cv, false, kPerHead> v;
  k.prepare(p.k, token, first);
  v.prepare(p.v, token, first);
  const int64_t slot = resolve_slot(p, entry);
  if (slot < 0) return;  // padding: nothing else is read
  k.load_scale(p.k);
  v.load_scale(p.v);
  k.load(slot < p.k.num_slots);  // out-of-range slots are never written
  v.load(slot < p.v.num_slots);
  k.store(slot_row(p.k, slot));
  v.store(slot_row(p.v, slot));
}

// grid = (ceil(n / warps_per_block), chunks, sides), block = 32 * warps_per_block; one warp per
// (token, chunk), writing K and V. With split_sides (sides = 2), one warp per (token, chunk, side),
// which halves each warp's fp8 conversion chain; bf16 copies stay on one warp (measured slower split).
// kTable: the slots from FlashInfer's page table (TableStoreCacheArgs).
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcDtype kSrc, KvFormat kFmt, bool kBulk, bool kPerHead,
          bool kTable>
__global__ void __launch_bounds__(32 * kMaxWarpsPerBlock) store_cache_kernel(const __grid_constant__ ArgsOf<kTable> p) {
  if constexpr (kBulk) {
    bulk_write<kKHeadBytes, kVHeadBytes, kVec, kSrc, kFmt, kPerHead, kTable>(p);
  } else {
    latency_write<kKHeadBytes, kVHeadBytes, kVec, kSrc, kFmt, kPerHead, kTable>(p);
  }
}

}  // namespace jitkv::store_cache
