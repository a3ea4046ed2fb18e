// Paged caches: slot s lives in block s / block_size, row s % block_size; its row is at
//   base + (s / block_size) * block_stride + (s % block_size) * token_stride
//   = base + s * token_stride + (s / block_size) * block_adj,  block_adj = block_stride - block_size * token_stride,
// so that s * token_stride is computed while the block number is, and a lone warp's chain from slot to
// store stays short. NHD and HND caches differ in their strides only (a head's stride is added to the
// row); a flat cache is block_size 1 with block_stride == token_stride (block_adj 0). The division by
// block_size is set up on the host once per call (block_division) and runs on the device as block_of:
// a multiply-high, an add and a shift, no branch. FlashInfer's page tables (jitkv/page_table.h) are
// checked into their block by parse_page_table and walked by page_table_slot.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jitkv/check.h"
#include "jitkv/cuda/vec.cuh"
#include "jitkv/page_table.h"

namespace jitkv {
namespace cuda {

// slot / block_size as (umulhi(slot, magic) + slot) >> shift (round-up method: shift =
// ceil(log2(block_size)), magic = floor(2^32 (2^shift - block_size) / block_size) + 1).
struct BlockDivision {
  uint32_t magic;
  int32_t shift;
};

inline BlockDivision block_division(int64_t block_size) {
  int32_t shift = 0;
  while ((int64_t(1) << shift) < block_size) ++shift;
  const auto magic =
      static_cast<uint32_t>((((uint64_t(1) << shift) - uint64_t(block_size)) << 32) / uint64_t(block_size) + 1);
  return {magic, shift};
}

// Whether block_of is exact for every slot of a cache of num_slots: always for a power of two (magic
// 1, umulhi 0, an exact shift), else for slots below 2^32.
inline bool block_division_exact(int64_t block_size, int64_t num_slots) {
  return (block_size & (block_size - 1)) == 0 || num_slots <= int64_t(UINT32_MAX);
}

constexpr int64_t block_adj(int64_t block_stride, int64_t block_size, int64_t token_stride) {
  return block_stride - block_size * token_stride;
}

// slot / block_size for a slot in [0, num_slots), without a branch or a division (block_division_exact).
__device__ __forceinline__ uint64_t block_of(int64_t slot, uint32_t magic, int32_t shift) {
  return (uint64_t(__umulhi(uint32_t(slot), magic)) + uint64_t(slot)) >> shift;
}

// The destination geometry of one paged cache, in registers.
struct PagedRows {
  char* base;
  int64_t token_stride, block_adj;
  uint32_t block_magic;
  int32_t block_shift;

  __device__ __forceinline__ uint64_t block(int64_t slot) const { return block_of(slot, block_magic, block_shift); }

  __device__ __forceinline__ char* row(int64_t slot, uint64_t blk) const {
    return base + (slot * token_stride + int64_t(blk) * block_adj);
  }
};

// The table of a call of n tokens: each index int32 or int64, 1-D and contiguous (check_index), on dev
// (named dest_name in errors); batch_indices and positions of n entries, kv_indptr of at least one,
// 1 <= page_size < 2^31. The Python callers check what a user passes first; these checks keep a direct
// call from reading out of bounds.
inline PageTable parse_page_table(const char* op, const TensorView& batch_indices, const TensorView& positions,
                                  const TensorView& kv_indices, const TensorView& kv_indptr, int64_t page_size,
                                  int64_t n, DLDevice dev, const char* dest_name) {
  PageTable t;
  t.batch_i64 = check_index(op, "batch_indices", batch_indices);
  t.pos_i64 = check_index(op, "positions", positions);
  t.indices_i64 = check_index(op, "kv_indices", kv_indices);
  t.indptr_i64 = check_index(op, "kv_indptr", kv_indptr);
  for (const auto& [name, x] : {std::pair<const char*, const TensorView*>{"batch_indices", &batch_indices},
                                {"positions", &positions},
                                {"kv_indices", &kv_indices},
                                {"kv_indptr", &kv_indptr}}) {
    check_device(op, name, *x, dev, dest_name);
  }
  if (batch_indices.size(0) != n || positions.size(0) != n) {
    TVM_FFI_THROW(ValueError) << op << ": batch_indices, positions: expected " << n << " entries each, got "
                              << batch_indices.size(0) << " and " << positions.size(0);
  }
  if (kv_indptr.size(0) < 1) TVM_FFI_THROW(ValueError) << op << ": kv_indptr: expected at least 1 entry, got 0";
  if (page_size < 1 || page_size > INT32_MAX) {
    TVM_FFI_THROW(ValueError) << op << ": page_size: expected 1 ... 2^31 - 1, got " << page_size;
  }
  const BlockDivision div = block_division(page_size);
  t.batch_indices = data_ptr(batch_indices);
  t.positions = data_ptr(positions);
  t.kv_indices = data_ptr(kv_indices);
  t.kv_indptr = data_ptr(kv_indptr);
  t.page_size = page_size;
  t.num_indices = kv_indices.size(0);
  t.num_indptr = kv_indptr.size(0);
  t.page_magic = div.magic;
  t.page_shift = div.shift;
  return t;
}

// A kernel's parameter block takes the call's table where its build reads one (kTable: the block has
// `pages`, PageTable); the other builds' blocks have no room for it.
template <bool kTable, class Block>
inline void set_page_table(Block& block, const PageTable& table) {
  if constexpr (kTable) block.pages = table;
}

__device__ __forceinline__ int64_t clamp_index(int64_t i, int64_t size) { return i < 0 ? 0 : i >= size ? size - 1 : i; }

// Where token t's guess for page_table_slot is loaded from: its request's entry if batch_indices[t] = t.
__device__ __forceinline__ int64_t indptr_guess(const PageTable& table, int64_t t) {
  return clamp_index(t, table.num_indptr);
}

// The entry of kv_indices that holds the page of a token of request b >= 0 at sequence position pos in
// table t (jitkv/page_table.h; a non-empty kv_indices), and in `row` its row in that page: a kv_indptr
// load, skipped where b is guess_b, whose kv_indptr entry the caller loaded beside b as guess_start
// (indptr_guess: in decode every request has one token, batch_indices[t] = t, so the walk is one load
// deep after batch_indices, as a slot_mapping's store is). A position in [0, 2^32) divides as block_of
// does (exact there: block_division_exact), others by the 64-bit division (a call of ~70 instructions).
// In rope_store_cache's paged build a 32-bit division here measured 0.09 µs slower at n <= 64 than a
// shift, and the guess 0.07-0.17 µs faster at n = 1-128 (docs/performance.md "FlashInfer page slots").
__device__ __forceinline__ int64_t page_entry(const PageTable& t, int64_t b, int64_t pos, int64_t guess_b,
                                              int64_t guess_start, int64_t& row) {
  int64_t page_of;
  if (uint64_t(pos) <= UINT32_MAX) {
    page_of = int64_t(block_of(pos, t.page_magic, t.page_shift));
    row = pos - page_of * t.page_size;
  } else {
    page_of = pos / t.page_size;
    row = pos % t.page_size;
    if (row < 0) {  // floor division, as the torch form's
      row += t.page_size;
      page_of -= 1;
    }
  }
  const int64_t start =
      b == guess_b ? guess_start : load_index(t.kv_indptr, t.indptr_i64, clamp_index(b, t.num_indptr));
  return clamp_index(start + page_of, t.num_indices);
}

// The slot of a token of request b at sequence position pos in table t, -1 for none: page_entry's, then
// the kv_indices load, after the caller's PDL wait.
__device__ __forceinline__ int64_t page_table_slot(const PageTable& t, int64_t b, int64_t pos, int64_t guess_b,
                                                   int64_t guess_start) {
  if (b < 0 || t.num_indices <= 0) return -1;
  int64_t row;
  const int64_t e = page_entry(t, b, pos, guess_b, guess_start, row);
  return load_index(t.kv_indices, t.indices_i64, e) * t.page_size + row;
}

// page_table_slot issued up to its kv_indices load: the page (page.value()) and the row in it, or none. A
// caller with work that does not need the row (rope_store_cache's rotation) reads the page after that
// work, which then does not wait for the load (docs/performance.md "FlashInfer page slots").
struct PageWalk {
  LoadedIndex page = {0, 0, false};
  int64_t row = 0;
  bool none = true;
};

__device__ __forceinline__ PageWalk page_table_walk(const PageTable& t, int64_t b, int64_t pos, int64_t guess_b,
                                                    int64_t guess_start) {
  PageWalk w;
  if (b < 0 || t.num_indices <= 0) return w;
  const int64_t e = page_entry(t, b, pos, guess_b, guess_start, w.row);
  w.page = load_index_later(t.kv_indices, t.indices_i64, e);
  w.none = false;
  return w;
}

// A token's entries of table `table`, loaded together after the caller's PDL wait (batch_indices[t],
// positions[t] and the guessed kv_indptr[t]); slot() walks the rest (page_table_slot), after the
// caller's trigger. page_slots' kernel and store_cache's page-table builds take their slots so.
struct TableEntries {
  int64_t b, pos, start, t;
  __device__ __forceinline__ TableEntries(const PageTable& table, int64_t t_)
      : b(load_index(table.batch_indices, table.batch_i64, t_)),
        pos(load_index(table.positions, table.pos_i64, t_)),
        start(load_index(table.kv_indptr, table.indptr_i64, indptr_guess(table, t_))),
        t(t_) {}
  __device__ __forceinline__ int64_t slot(const PageTable& table) const {
    return page_table_slot(table, b, pos, t, start);
  }
};

// TableEntries as a kernel's slot source, the shape of its slot_mapping forms (store_cache's SlotEntry
// and RowSlot): constructed from the kernel's block (whose `pages` is the call's table) after the PDL
// wait, value() after the trigger.
struct TableSlot {
  TableEntries entries;
  template <class Args>
  __device__ __forceinline__ TableSlot(const Args& p, int64_t t) : entries(p.pages, t) {}
  template <class Args>
  __device__ __forceinline__ int64_t value(const Args& p) const {
    return entries.slot(p.pages);
  }
};

}  // namespace cuda
}  // namespace jitkv
