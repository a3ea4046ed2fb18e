// rope's parameter blocks, shared by host and device (docs/design.md §9): the rows of one rotated tensor,
// the rotation every token shares (positions, the cos/sin table) and what happens to the queries. The
// CPU binding (rope_cpu.cpp) reads them as parse.h fills them; a CUDA kernel's own compact block is built
// from the same fields.
#pragma once

#include <cstdint>

#include "jitkv/codes.h"
#include "jitkv/page_table.h"

namespace jitkv::rope {

using codes::RopeQ;

// The least power of two >= x: the norm's group sums are folded by halves, zero-padded to it (the CUDA
// lanes' shuffle groups, the CPU scratch).
constexpr int64_t pow2_at_least(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

// The format the queries are stored in (copy: the sources' dtype).
constexpr codes::KvFormat q_format(RopeQ q) {
  return q == RopeQ::kE4M3   ? codes::KvFormat::kE4M3
         : q == RopeQ::kE5M2 ? codes::KvFormat::kE5M2
                             : codes::KvFormat::kCopy;
}

// Rows of one tensor, [n', H, W] (2-D rows: one head, stride_head 0). Strides in bytes.
struct Rows {
  char* ptr;
  int64_t stride_token, stride_head;
};

// The rotation every token shares: its position's row of the cos/sin table.
struct Rotation {
  const void* positions;
  bool pos_i64;
  int64_t max_pos;
  const char* cos_sin;       // [max_pos, rot]: cos half then sin half
  int64_t cs_stride;         // bytes
  codes::SrcDtype cs_dtype;  // F32 or the sources' dtype
  int64_t rot;               // rotary dim (even)
  bool neox;                 // NeoX halves, else GPT-J pairs
};

// The queries: rotated from src into dst (dst == src in place) as mode says.
struct Queries {
  RopeQ mode;
  Rows src, dst;
  int64_t heads;
  const float* scale_ptr;  // fp8 q_out: a 1-element float32 tensor, or nullptr: scale
  float scale;
};

// rope_store_cache's CUDA block. Cache rows: slot s of a side at cache + s * token + (s / block_size) *
// block_adj (jitkv/cuda/paged.cuh), head h at + h * head; s = slots[t] (PagedStoreArgs: the slot
// page_table_slot gives).
struct StoreArgs {
  const char *q_src, *k_src, *v_src;
  char *q_dst, *k_out, *k_cache, *v_cache;  // k_out nullptr: none
  const void *slots, *loc_map, *positions;  // loc_map nullptr: no translation
  const char* cos_sin;
  const char *q_norm, *k_norm;                           // read when the build norms q / k (StoreShape kNorms)
  const float *q_scale_ptr, *k_scale_ptr, *v_scale_ptr;  // fp8: device scales, or nullptr: the values
  int64_t q_src_token, q_src_head, q_dst_token, q_dst_head, k_src_token, k_src_head, v_src_token, v_src_head;
  int64_t k_out_token, k_out_head;
  int64_t k_token, k_block_adj, k_head, v_token, v_block_adj, v_head;
  int64_t cs_stride, n, max_pos, k_num_slots, v_num_slots, skip_slot, loc_map_size;
  uint32_t k_magic, v_magic;
  int32_t k_shift, v_shift;
  float q_scale, k_scale, v_scale, eps;
  int32_t k_scale_stride, v_scale_stride;  // elements from one head's scale to the next (0: one scale)
  int32_t q_heads, kv_heads;
  int32_t slot_i64, loc_i64, pos_i64;
};

// The block of builds reading FlashInfer's page table (kernels.cuh StoreShape kPaged): slots is its
// batch_indices. A block of its own, so that the other builds' block (which each thread warms, line by
// line: cuda::warm_params) stays as it is.
struct PagedStoreArgs : StoreArgs {
  PageTable pages;
  // The caches' block strides and block counts: a page's row at page * block_stride + row * token
  // (kernels.cuh paged_row; the page size is the caches' block size).
  int64_t k_block_stride, v_block_stride, k_blocks, v_blocks;
};

// rope_set_mla_kv_buffer's CUDA block.
struct MlaArgs {
  char* dst;
  const char *kv_c, *k_pe, *q_pe, *q_nope;
  char *k_pe_out, *q_dst;  // k_pe_out nullptr: none; q_dst: q_pe (in place) or q_out
  const void *loc, *positions;
  const char* cos_sin;
  const float *scale_ptr, *q_scale_ptr;
  int64_t dst_stride, kv_c_stride, k_pe_stride, k_pe_out_stride;
  int64_t q_pe_token, q_pe_head, q_nope_token, q_nope_head, q_dst_token, q_dst_head;
  int64_t cs_stride, n, max_pos, num_slots, skip_slot;
  float scale, q_scale;
  int32_t q_heads, nope_q_lanes;  // q_out: lanes of kV values in a head's q_nope (0 in place)
  int32_t loc_i64, pos_i64;
};

// The block of builds reading FlashInfer's page table (mla_kernels.cuh MlaShape kPaged): loc is its
// batch_indices, a row's slot the one page_table_slot gives. Slot s's rope part goes to rope_dst + s *
// rope_dst_stride: after the kv_c part in dst's row, or into a cache of its own (FlashInfer's separate
// ckv and kpe caches).
struct PagedMlaArgs : MlaArgs {
  PageTable pages;
  char* rope_dst;
  int64_t rope_dst_stride;
};

}  // namespace jitkv::rope
