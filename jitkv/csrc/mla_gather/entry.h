// gather_mla_cache's row -> cache entry rule, one function for the CPU kernel (gather_mla_cache_cpu.cpp)
// and the CUDA kernel (gather.cuh).
//
// Output row t belongs to request r, the largest r < num_reqs with cu_seq_lens[r] <= t, when
// t < cu_seq_lens[r + 1] (other rows are never written); it is token i = t - cu_seq_lens[r], at
// position p = seq_starts[r] + i (no seq_starts: p = i) of the request's block table: block
// block_table[r, p / block_size], row p % block_size. A position < 0 or past the table's width, or a
// block entry < 0 or >= num_blocks, gives a zero row: nothing outside the cache is read. Rows are
// those of out only: out.shape[0] is the total the kernel covers (graph-safe: the device-side
// cu_seq_lens[num_reqs] is never read on the host), so requests running past it are clipped.
#pragma once

#include <cstdint>

#include "jitkv/host_device.h"
#include "mla_gather/params.h"

#if defined(__CUDACC__)
#include "jitkv/cuda/vec.cuh"
#endif

namespace jitkv::mla_gather {

constexpr int64_t kNotWritten = -2;  // entry_offset: output row t belongs to no request
constexpr int64_t kZeroRow = -1;     // entry_offset: written as zeros

JITKV_HOST_DEVICE inline int64_t load_index(const void* p, int64_t i, bool i64) {
#if defined(__CUDA_ARCH__)
  return i64 ? cuda::load(static_cast<const int64_t*>(p) + i)
             : static_cast<int64_t>(cuda::load(static_cast<const int32_t*>(p) + i));
#else
  return i64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
#endif
}

// Byte offset in the cache of output row t's entry (0 <= t < rows), or kZeroRow / kNotWritten.
// The request is found by binary search over cu_seq_lens (a few hundred bytes that stay in cache).
JITKV_HOST_DEVICE inline int64_t entry_offset(const GatherParams& p, int64_t t) {
  if (p.num_reqs <= 0) return kNotWritten;
  int64_t lo = 0, hi = p.num_reqs;  // the answer is in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (load_index(p.cu_seq_lens, mid, p.cu_i64) <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int64_t start = load_index(p.cu_seq_lens, lo, p.cu_i64);
  const int64_t end = load_index(p.cu_seq_lens, lo + 1, p.cu_i64);
  if (t < start || t >= end) return kNotWritten;
  // Wrapping (unsigned) add, as the torch reference's int64 arithmetic: any seq_starts stays defined.
  const int64_t first = p.seq_starts ? load_index(p.seq_starts, lo, p.starts_i64) : 0;
  const int64_t pos = static_cast<int64_t>(static_cast<uint64_t>(t - start) + static_cast<uint64_t>(first));
  if (pos < 0) return kZeroRow;
  int64_t blk, row;
  if (pos <= UINT32_MAX && p.block_size <= UINT32_MAX) {  // 32-bit division: the common case, far cheaper on GPUs
    const uint32_t q = static_cast<uint32_t>(pos) / static_cast<uint32_t>(p.block_size);
    blk = q;
    row = static_cast<uint32_t>(pos) - q * static_cast<uint32_t>(p.block_size);
  } else {
    blk = pos / p.block_size;
    row = pos - blk * p.block_size;
  }
  if (blk >= p.max_blocks) return kZeroRow;
  const int64_t phys = load_index(p.block_table, lo * p.bt_row_stride + blk, p.bt_i64);
  if (phys < 0 || phys >= p.num_blocks) return kZeroRow;
  return phys * p.block_stride + row * p.token_stride;
}

}  // namespace jitkv::mla_gather
