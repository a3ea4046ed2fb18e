// rope's launch geometry, picked on the host per call (rope_store_cache_cuda.cu,
// rope_set_mla_kv_buffer_cuda.cu): threads per block and heads per thread, with the kernels' launch bounds
// (kernels.cuh).
#pragma once

#include <cstdint>

namespace jitkv::rope {

// Threads per block (a token's threads span grid.y blocks): kBlockThreads, except for rope_store_cache's
// kernels without the norm at one or kPairHpt heads per thread, which run faster on an H200 in fewer,
// larger blocks while the launch leaves the SMs room: 256 threads under one 128-thread block's worth per
// SM, 384 under 1536 threads per SM (the normed kernels and MLA's measured no faster). Each kernel is
// built for the largest block it is launched with (block_bounds), so that the others keep their
// registers. Re-measure: docs/performance.md "rope threads per block".
constexpr int kBlockThreads = 128, kWideBlockThreads = 384;

// Heads per thread: one while a thread per head lane fills the GPU less than threads_per_sm times
// (latency: the most threads, the shortest chain each), kBulkHpt beyond where it divides the head
// counts (each thread then has kBulkHpt loads in flight and reads the cos/sin row once for them).
// threads_at_one: the launch's threads at one head per thread. The thresholds per op (MLA's q_pe
// threads hold one 16-byte lane each and a cos/sin load, so they gain from sharing it far sooner).
// Between them, rope_store_cache's builds that quantize q without a norm take kPairHpt from
// kPairThreadsPerSm to kPairEndPerSm threads per SM (pair_heads): their q threads, two thirds of a
// token's, each repeat the position, cos/sin and divider work that a pair shares.
// Re-measure: docs/performance.md "rope heads per thread", "rope pairs of heads".
constexpr int kBulkHpt = 4, kPairHpt = 2;
constexpr int64_t kMhaThreadsPerSm = 2048, kMlaThreadsPerSm = 128;
constexpr int64_t kPairThreadsPerSm = 256, kPairEndPerSm = 1536;

// rope_set_mla_kv_buffer's blocks: kBlockThreads, or kMlaWideBlockThreads for its kBulkHpt kernel once
// the launch gives every SM kMlaWideBlocksPerSm such blocks: with an fp8 q_out (FlashInfer's MLA case) the
// larger blocks moved the same bytes 3-8 % faster at n >= 2048 on an H200, level at n = 512. Re-measure:
// docs/performance.md "rope MLA blocks".
constexpr int kMlaWideBlockThreads = 512, kMlaWideBlocksPerSm = 4;

constexpr int mla_block_bounds(int hpt) { return hpt == kBulkHpt ? kMlaWideBlockThreads : kBlockThreads; }

// threads: the launch's threads in all.
inline int mla_block_threads(int hpt, int64_t threads, int sms) {
  const int64_t per_sm = threads / (sms > 1 ? sms : 1);
  const bool wide = mla_block_bounds(hpt) == kMlaWideBlockThreads;
  return wide && per_sm >= int64_t{kMlaWideBlocksPerSm} * kMlaWideBlockThreads ? kMlaWideBlockThreads : kBlockThreads;
}

constexpr int block_bounds(bool normed, int hpt) {
  return !normed && hpt <= kPairHpt ? kWideBlockThreads : kBlockThreads;
}

// threads: the launch's threads in all.
inline int block_threads(bool normed, int hpt, int64_t threads, int sms) {
  const int64_t per_sm = threads / (sms > 1 ? sms : 1);
  if (block_bounds(normed, hpt) == kBlockThreads || per_sm >= 1536) return kBlockThreads;
  return per_sm < kBlockThreads ? 256 : kWideBlockThreads;
}

inline int heads_per_thread(bool divides, int64_t threads_at_one, int sms, int64_t threads_per_sm) {
  return divides && threads_at_one >= threads_per_sm * (sms > 1 ? sms : 1) ? kBulkHpt : 1;
}

// heads_per_thread's choice hpt, or kPairHpt where a build with kPairs takes it (pair_divides: kPairHpt
// divides both head counts).
inline int pair_heads(int hpt, bool pairs, bool pair_divides, int64_t threads_at_one, int sms) {
  const int64_t per_sm = threads_at_one / (sms > 1 ? sms : 1);
  const bool band = per_sm >= kPairThreadsPerSm && per_sm < kPairEndPerSm;
  return hpt == 1 && pairs && pair_divides && band ? kPairHpt : hpt;
}

// rope_store_cache's heads per thread for q_heads and kv_heads: heads_per_thread where kBulkHpt divides
// both head counts, then pair_heads for builds that take pairs (pairs: StoreShape::kPairs) where kPairHpt
// divides both. threads_at_one: the launch's threads at one head per thread.
inline int mha_heads_per_thread(int64_t q_heads, int64_t kv_heads, int64_t threads_at_one, int sms, bool pairs) {
  const bool bulk = q_heads % kBulkHpt == 0 && kv_heads % kBulkHpt == 0;
  const bool pair = q_heads % kPairHpt == 0 && kv_heads % kPairHpt == 0;
  return pair_heads(heads_per_thread(bulk, threads_at_one, sms, kMhaThreadsPerSm), pairs, pair, threads_at_one, sms);
}

}  // namespace jitkv::rope
