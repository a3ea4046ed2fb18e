// The DeepSeek-V4 FP8 K cache (docs/design.md §5): the record's constants as the kernels use them and
// the parameter blocks of the writer (quantize_and_insert_k_cache) and the gather
// (dequantize_and_gather_k_cache), shared by the binding (dsv4_cuda.cu) and the kernels.
//
// Layout (the codes::Dsv4 record): one head of 512 dims per token: dims 0..447 as e4m3 (448 B) + dims
// 448..511 as bf16 (128 B) = 576 B of data, plus 8 B of UE8M0 scales (7 groups of 64 dims, 8th byte 0).
// A block of block_size tokens holds all token data first (token t at t*576), then all scales (token t
// at block_size*576 + t*8): block_size*584 bytes, then any padding up to the block stride (a multiple
// of 16 bytes). The kernels' lane mapping is written for these numbers, which the static_assert checks.
#pragma once

#include <cstdint>

#include "jitkv/codes.h"

namespace jitkv::dsv4 {

using Record = codes::Dsv4;
constexpr int kHeadDim = Record::kHeadDim;
constexpr int kNopeDim = Record::kNope;            // dims stored as e4m3
constexpr int kRopeDim = Record::kRope;            // dims stored as bf16
constexpr int kGroupSize = Record::kGroup;         // dims per UE8M0 scale
constexpr int kNumGroups = kNopeDim / kGroupSize;  // real scales
constexpr int kNopeBytes = kNopeDim;               // one e4m3 byte per dim
constexpr int kDataBytes = Record::kDataBytes;     // e4m3 + bf16
constexpr int kScaleBytes = Record::kScaleBytes;   // scales + zero padding
constexpr int kTokenBytes = Record::kTokenBytes;
static_assert(kHeadDim == 512 && kNopeDim == 448 && kGroupSize == 64 && kScaleBytes == 8 &&
                  kRopeDim == kHeadDim - kNopeDim && kDataBytes == kNopeBytes + 2 * kRopeDim,
              "the lane mapping of these kernels is written for the 512-dim record of 448 e4m3 + 64 bf16");

// Bytes from a block's start to its scale region.
constexpr int64_t scale_offset(int64_t block_size) { return block_size * kDataBytes; }

// Launch constants (docs/performance.md "DeepSeek-V4 launch constants").
constexpr int kWriteWarps = 8;
constexpr int kWriteTok = 1;         // tokens per writer warp
constexpr int kGatherWarps = 4;      // warps per gather CTA
constexpr int kGatherTok = 2;        // tokens per gather warp
constexpr int64_t kGatherWaves = 4;  // gather grid cap, in resident-CTA waves
// Registers capped for a full SM (2048 threads, so 32 per thread): more warps, more loads in flight.
constexpr int kGatherMinCtas = 2048 / (kGatherWarps * 32);
static_assert(kWriteTok <= 32 && kGatherTok <= 32, "one lane resolves each token of a warp");

struct WriteParams {
  const uint16_t* k;  // bf16 bits
  int64_t k_stride;   // elements between rows of k
  uint8_t* cache;
  int64_t block_stride;  // bytes
  int64_t num_slots;     // num_blocks * block_size
  const void* slots;
  int64_t n;
  int64_t block_size;
};

struct GatherParams {
  uint16_t* out;           // bf16 bits
  int64_t out_s0, out_s1;  // elements
  int64_t rows;            // out.shape[1] - offset: rows each request may fill
  int64_t offset;
  const uint8_t* cache;
  int64_t block_stride;  // bytes
  int64_t num_blocks;
  const int32_t* seq_lens;
  const int32_t* gather_lens;  // null: gather whole sequences
  const int32_t* block_table;
  int64_t bt_stride;
  int64_t max_blocks;
  int32_t block_size;
  int64_t tiles_per_req;
  int64_t num_tiles;
};

}  // namespace jitkv::dsv4
