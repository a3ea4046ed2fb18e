// FlashInfer's page-table indexing (jitkv/compat/flashinfer.py page_slots: the contract and its torch
// form): token t of request b = batch_indices[t] >= 0 at position pos = positions[t] of its sequence goes
// to slot kv_indices[e] * page_size + pos mod page_size, e = kv_indptr[b] + floor(pos / page_size); a
// token with b < 0, or any token of an empty kv_indices, to none (-1). b past kv_indptr and e outside
// kv_indices are clamped into them, so nothing is read outside a table (what such a slot then names is
// the caller's; jitkv's writes drop slots outside the cache). The block a CUDA kernel reads it from
// (cuda/paged.cuh: parse_page_table fills it from a call's tensors, page_table_slot walks it): page_slots'
// own kernel, and rope_store_cache's builds that read the table themselves.
#pragma once

#include <cstdint>

namespace jitkv {

struct PageTable {
  const void *batch_indices, *positions, *kv_indices, *kv_indptr;  // int32 or int64 each (the *_i64 flags)
  int64_t page_size, num_indices, num_indptr;
  uint32_t page_magic;  // pos / page_size as cuda::block_of (page_size < 2^31)
  int32_t page_shift;
  int32_t batch_i64, pos_i64, indices_i64, indptr_i64;
};

}  // namespace jitkv
