// The DeepSeek-V3.2 sparse-attention indexer K cache (docs/design.md §5.1): the parameter blocks of the
// writer indexer_k_quant_and_cache and the gather gather_indexer_k_quant_cache, shared by host and
// device, and the token -> request rule both bindings run (request_of).
//
// Layout (the codes::Indexer record): a block of block_size tokens holds every token's kHeadDim e4m3
// bytes (token t at byte t * kHeadDim), then every token's fp32 scale (token t at block_size * kHeadDim
// + t * 4); the block stride is the cache's stride(0).
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>

#include "jitkv/codes.h"
#include "jitkv/host_device.h"

namespace jitkv::indexer {

constexpr int64_t kHeadDim = codes::Indexer::kHeadDim;
constexpr int64_t kScaleBytes = codes::Indexer::kScaleBytes;
constexpr int64_t kTokenBytes = codes::Indexer::kTokenBytes;
constexpr float kFp8Max = codes::Indexer::kFP8Max;
constexpr float kAmaxMin = codes::Indexer::kAmaxMin;
static_assert(kScaleBytes == 4, "one fp32 scale per token");

// Writer. Shapes: k [n', kHeadDim] bf16/fp16 (n' >= n = slot_mapping.numel(), any row stride); the
// cache as parse_cache takes it. k_f16 and the slot type pick the kernel; device is for the host.
struct WriteParams {
  const char* k;
  char* cache;
  const void* slots;
  int64_t n, k_row_stride, block_stride, block_size, num_slots;  // strides: bytes
  int32_t slot_i64, ue8m0;
  int32_t k_f16;  // 0: bf16
  DLDevice device;
};

// Gather. dst_k [T, kHeadDim] uint8/e4m3; dst_scale [T] or [T, 1] float32, or [T, 4] uint8;
// block_table [batch, max_blocks] int32; cu_seq_lens [batch + 1] int32.
struct GatherParams {
  const char* cache;
  char* dst_k;
  char* dst_scale;
  const int32_t* block_table;
  const int32_t* cu_seq_lens;
  int64_t num_tokens, batch, max_blocks, bt_row_stride;                          // bt_row_stride: elements
  int64_t block_stride, block_size, num_blocks, dst_k_stride, dst_scale_stride;  // strides: bytes
  DLDevice device;
};

// The request covering token t: the last b with cu_seq_lens[b] <= t (a binary search over the batch + 1
// entries, as torch.searchsorted(right=True) - 1), if b < batch; else -1 (t before the first or past
// the last request). start receives cu_seq_lens[b]. cu_seq_lens must be non-decreasing.
template <typename Load>
JITKV_HOST_DEVICE inline int64_t request_of(int64_t t, int64_t batch, Load cu, int64_t& start) {
  int64_t lo = 0, hi = batch + 1;
  start = 0;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    const int64_t c = cu(mid);
    if (c <= t) {
      lo = mid + 1;
      start = c;
    } else {
      hi = mid;
    }
  }
  return lo >= 1 && lo <= batch ? lo - 1 : -1;
}

}  // namespace jitkv::indexer
