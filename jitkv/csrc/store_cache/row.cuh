// store_cache's row kernels: the latency kernel for the common decode call, with a compact parameter
// block (the other calls: kernels.cuh).
//
// When there is no loc_map, one scale per side (fp8: or contiguous per-head scales), and K and V rows
// are dense in the source and in the cache (heads back to back: flat [S, H*D] / [S, H, D] caches, paged
// NHD ones with one block size for K and V), vector i of a row sits at byte 16 i of the cache row and
// 16 i * ratio of the source row, so a side is two pointers and two strides, kept in 32 and 16 bits
// (16-byte units), and the kernel's parameter block is 64-88 bytes instead of StoreCacheArgs' 264.
// Under graph replay a launch's cost grows with its parameter block (jitkv/cuda/launch.cuh
// warm_params; docs/performance.md "RowArgs"); store_cache_cuda.cu (use_row_kernel) takes the calls
// whose values fit (fits_row_args). Specialised (16-byte) builds only.
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

namespace jitkv::store_cache {

struct RowArgs {
  const char* src[2];  // K, V
  char* dst[2];
  const void* slots;
  int32_t n, num_slots;
  uint32_t dst_stride16[2];  // bytes / 16 from one slot's cache row to the next
  uint16_t src_stride16[2];  // bytes / 16 from one token's source row to the next
  int32_t heads;

  __device__ __forceinline__ const char* src_of(int side) const { return src[side]; }
  __device__ __forceinline__ char* dst_of(int side) const { return dst[side]; }
  __device__ __forceinline__ int64_t src_stride(int side) const { return int64_t{src_stride16[side]} * 16; }
  __device__ __forceinline__ int64_t dst_stride(int side) const { return int64_t{dst_stride16[side]} * 16; }
};
static_assert(sizeof(RowArgs) == 64, "one 64-byte parameter block");

// The fp8 row kernels' block: RowArgs' fields and the two scales in the same 64 bytes. V's source and
// cache are offsets from K's (16-byte units), K and V share their row strides, and a scale is one word:
// a float32 pointer (a device scale; bit 1 set: per-head scales, [heads] contiguous), or the scale's
// bits << 32 | 1 (a Python float). Pointers to float32 are 4-byte aligned, so bits 0 and 1 are free.
// Calls whose values do not fit take the latency kernel (store_cache_cuda.cu fits_row_fp8_args). Against
// RowArgs with both scales (88 bytes), and per-head scales against the latency kernel:
// docs/performance.md "RowFp8Args".
struct RowFp8Args {
  const char* src;  // K's; V's is src + 16 * v_src16
  char* dst;        // K's; V's is dst + 16 * v_dst16
  const void* slots;
  int32_t v_src16, v_dst16;
  int32_t n, num_slots;
  uint32_t dst_stride16;  // K and V
  uint16_t src_stride16;  // K and V
  uint16_t heads;
  uint64_t scale[2];  // K, V

  __device__ __forceinline__ const char* src_of(int side) const { return src + (side ? int64_t{v_src16} * 16 : 0); }
  __device__ __forceinline__ char* dst_of(int side) const { return dst + (side ? int64_t{v_dst16} * 16 : 0); }
  __device__ __forceinline__ int64_t src_stride(int) const { return int64_t{src_stride16} * 16; }
  __device__ __forceinline__ int64_t dst_stride(int) const { return int64_t{dst_stride16} * 16; }
  // A side's scale: loaded from scale_at(side, head of the lane's vector) when scale_is_ptr(side), else
  // scale_value(side).
  __device__ __forceinline__ bool scale_is_ptr(int side) const { return !(scale[side] & 1); }
  __device__ __forceinline__ const float* scale_at(int side, uint32_t head) const {
    const uint64_t w = scale[side];
    return reinterpret_cast<const float*>((w & ~uint64_t{3}) + (w & 2 ? 4 * uint64_t{head} : 0));
  }
  __device__ __forceinline__ float scale_value(int side) const { return __uint_as_float(uint32_t(scale[side] >> 32)); }
};
static_assert(sizeof(RowFp8Args) == 64, "one 64-byte parameter block");

// Paged caches: a slot's row is dst + slot * dst_stride + (slot / block_size) * block_adj.
struct RowBlocks {
  int64_t k_block_adj, v_block_adj;  // block_adj(Side), per side
  uint32_t block_magic;              // the block division of Side (K and V share the block size)
  int32_t block_shift;
};

struct NoBlocks {};

// A page-table build's table (slots is its batch_indices: kernels.cuh SlotEntry).
struct RowTable {
  PageTable pages;
};

struct NoTable {};

// The block of one row kernel: RowArgs (copies) or RowFp8Args, then RowBlocks for paged caches, then
// the page table of a page-table build.
template <bool kPaged, bool kQuant, bool kTable>
struct RowArgsOf : std::conditional_t<kQuant, RowFp8Args, RowArgs>,
                   std::conditional_t<kPaged, RowBlocks, NoBlocks>,
                   std::conditional_t<kTable, RowTable, NoTable> {};

// A row kernel's slots[token] of TSlot: loaded after the PDL wait, value() after the trigger.
template <typename TSlot>
struct RowSlotMapping {
  int64_t entry;
  template <class Args>
  __device__ __forceinline__ RowSlotMapping(const Args& p, int64_t token)
      : entry(cuda::load(static_cast<const TSlot*>(p.slots) + token)) {}
  template <class Args>
  __device__ __forceinline__ int64_t value(const Args&) const {
    return entry;
  }
};

// A row kernel's slot source: slots of TSlot, or (kTable) the token's page-table entries (cuda::TableSlot).
template <bool kTable, typename TSlot>
using RowSlot = std::conditional_t<kTable, cuda::TableSlot, RowSlotMapping<TSlot>>;

// grid = (ceil(n / warps_per_block), chunks, sides) as the latency kernel; lane l of chunk c moves
// kVec-byte vector 32 c + l of the K row and of the V row (or, with split sides, of the side
// blockIdx.z picks). Every slot outside [0, num_slots) is skipped: the host passes no skip_slot inside it.
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcDtype kSrc, KvFormat kFmt, bool kPaged, typename TSlot,
          bool kTable>
__global__ void __launch_bounds__(32 * kMaxWarpsPerBlock)
    store_cache_row_kernel(const __grid_constant__ RowArgsOf<kPaged, kFmt != KvFormat::kCopy, kTable> p) {
  using Cv = Convert<kSrc, kFmt, false>;
  constexpr int kSrcVec = kVec * Cv::kRatio;
  constexpr bool kSplit = split_sides(kFmt, kKHeadBytes, kVHeadBytes, false);
  cuda::warm_params(p, p.n);
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const uint32_t i = blockIdx.y * 32 + (threadIdx.x & 31);
  const int first = kSplit && blockIdx.z ? 1 : 0;  // the side this warp writes first: V with split sides
  const uint32_t k_head_vecs = (first ? kVHeadBytes : kKHeadBytes) / kVec, v_head_vecs = kVHeadBytes / kVec;
  const bool k_in = i < uint32_t(p.heads) * k_head_vecs;
  const bool v_in = !kSplit && i < uint32_t(p.heads) * v_head_vecs;
  const char* k_src = p.src_of(first) + token * p.src_stride(first) + i * kSrcVec;
  const char* v_src = p.src_of(1) + token * p.src_stride(1) + i * kSrcVec;
  // fp8: where this lane's scales lie (per-head scales: those of vector i's heads), and whether it loads
  // them (a device scale, vector i inside the row): parameter-block arithmetic, kept apart from the
  // loads by an empty asm (the form the RowFp8Args measurements timed; the scale loads issue after
  // the row loads).
  const float *k_scale_at = nullptr, *v_scale_at = nullptr;
  uint32_t k_scale_load = 0, v_scale_load = 0;
  if constexpr (Cv::kQuant) {
    k_scale_at = p.scale_at(first, i / k_head_vecs);
    v_scale_at = p.scale_at(1, i / v_head_vecs);
    k_scale_load = k_in && p.scale_is_ptr(first);
    v_scale_load = v_in && p.scale_is_ptr(1);
    asm volatile("" : "+l"(k_scale_at), "+l"(v_scale_at), "+r"(k_scale_load), "+r"(v_scale_load));
  }
  if (token >= p.n) return;
  cuda::pdl_wait();  // sources, indices and device scales may come from the previous kernel
  const RowSlot<kTable, TSlot> slot_entry(p, token);
  Pack<kSrcVec> kd, vd;
  if (k_in) kd = cuda::load_pack<kSrcVec>(k_src);
  if (v_in) vd = cuda::load_pack<kSrcVec>(v_src);
  cuda::pdl_launch_dependents();  // after the loads (as mla/copy.cuh's latency kernel)
  // fp8: the scales after the row loads; loaded first (and the reciprocal pinned before the slot
  // check) the e4m3 write measured slower (docs/performance.md "store_cache_row_kernel").
  cuda::Divider k_div, v_div;
  if constexpr (Cv::kQuant) {
    k_div = cuda::Divider(k_scale_load ? cuda::load(k_scale_at) : p.scale_value(first));
    if constexpr (!kSplit) v_div = cuda::Divider(v_scale_load ? cuda::load(v_scale_at) : p.scale_value(1));
  }
  // Padding (< 0) and out-of-range slots are never written.
  const int64_t slot = slot_entry.value(p);
  if (uint64_t(slot) >= uint64_t(p.num_slots)) return;
  int64_t k_row = slot * p.dst_stride(first), v_row = slot * p.dst_stride(1);
  if constexpr (kPaged) {
    const int64_t blk = int64_t(cuda::block_of(slot, p.block_magic, p.block_shift));
    k_row += blk * (first ? p.v_block_adj : p.k_block_adj);
    v_row += blk * p.v_block_adj;
  }
  if (k_in) cuda::store_pack<kVec>(p.dst_of(first) + k_row + i * kVec, Cv::template run<kVec>(kd, k_div));
  if (v_in) cuda::store_pack<kVec>(p.dst_of(1) + v_row + i * kVec, Cv::template run<kVec>(vd, v_div));
}

}  // namespace jitkv::store_cache
