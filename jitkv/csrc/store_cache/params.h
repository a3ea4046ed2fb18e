// store_cache's parameter blocks, shared by host and device: one side (K or V) of a call and what the
// latency and bulk kernels read (their whole parameter block; every 64-byte line of it is warmed before
// the PDL wait: jitkv/cuda/launch.cuh warm_params). The row kernels' compact blocks: row.cuh.
#pragma once

#include <cstdint>
#include <type_traits>

#include "jitkv/page_table.h"

namespace jitkv::store_cache {

// One of K / V: its source rows and its cache. Strides in bytes. Slot s lives at dst + (s / block_size)
// * dst_stride_block + (s % block_size) * dst_stride_token, head h at + h * dst_stride_head; flat caches
// have block_size 1 and dst_stride_block == dst_stride_token == the row stride.
struct Side {
  const char* src;
  int64_t src_stride_token, src_stride_head;
  char* dst;
  int64_t num_slots, block_size, dst_stride_block, dst_stride_token, dst_stride_head;
  int32_t head_vecs, row_vecs;  // CUDA: kVec-byte destination vectors per head and per row
  int32_t block_shift;          // CUDA: slot / block_size (jitkv/cuda/paged.cuh block_of; the CUDA binding
  uint32_t block_magic;         // sets these four, exact for every slot of a cache it accepts)
  const float* scale_ptr;       // fp8: a float32 tensor on the caches' device, or nullptr: `scale`
  float scale;
  int32_t scale_stride;  // elements from one head's scale to the next: 0 for one scale for all heads
};

struct StoreCacheArgs {
  Side k, v;
  const void* slots;
  const void* loc_map;  // nullptr: no translation
  int64_t loc_map_size, n, skip_slot;
  int32_t slot_i64, loc_i64;
  int32_t same_blocks;  // 1: K and V caches have the same block size (a slot's block and row agree)
};

// A page-table build's block (JITKV_PAGE_TABLE; kernels.cuh SlotEntry): slots is FlashInfer's
// batch_indices, token t's slot FlashInfer's rule (jitkv/page_table.h). A block of its own, so that the
// other builds' block (each thread warms it, line by line) stays as it is.
struct TableStoreCacheArgs : StoreCacheArgs {
  PageTable pages;
};

template <bool kTable>
using ArgsOf = std::conditional_t<kTable, TableStoreCacheArgs, StoreCacheArgs>;

}  // namespace jitkv::store_cache
