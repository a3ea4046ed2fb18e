// A store_cache::Side as the CPU kernels write it (store_cache_cpu.cpp, rope/rope_cpu.cpp): a slot's row,
// the bytes the cache spans, and whether streaming stores may write its segments.
#pragma once

#include <cstdint>

#include "jitkv/cpu/row_copy.h"
#include "jitkv/cpu/scatter.h"
#include "store_cache/params.h"

namespace jitkv::store_cache {

// The first byte of slot's row (block slot / block_size, token slot % block_size).
inline char* slot_row(const Side& s, int64_t slot) {
  if (s.block_size == 1) return s.dst + slot * s.dst_stride_block;
  return s.dst + (slot / s.block_size) * s.dst_stride_block + (slot % s.block_size) * s.dst_stride_token;
}

// Bytes from the cache's first block to past its last (cpu::want_streaming's destination span).
inline int64_t span_bytes(const Side& s) {
  return s.block_size > 0 ? (s.num_slots / s.block_size) * cpu::abs64(s.dst_stride_block) : 0;
}

// Every destination segment starts on a 64-byte line (streaming stores need it): each row, and each
// head where the heads are written as segments of their own (per_head).
inline bool lines_aligned(const Side& s, bool per_head) {
  return cpu::aligned64(s.dst) && s.dst_stride_block % 64 == 0 && (s.block_size == 1 || s.dst_stride_token % 64 == 0) &&
         (!per_head || s.dst_stride_head % 64 == 0);
}

// Whether dst_bytes written by `threads` threads into the K and V caches go by streaming stores:
// cpu::want_streaming over both caches' span, and every segment of each on a line (its heads each a
// segment where k_per_head / v_per_head).
inline bool streamed(const Side& k, bool k_per_head, const Side& v, bool v_per_head, int64_t dst_bytes, int threads) {
  return cpu::want_streaming(span_bytes(k) + span_bytes(v), dst_bytes, threads) && lines_aligned(k, k_per_head) &&
         lines_aligned(v, v_per_head);
}

}  // namespace jitkv::store_cache
