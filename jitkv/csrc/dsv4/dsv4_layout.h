// DeepSeek-V4 FP8 K cache layout (docs/design.md §5), shared by the CUDA kernels and the tvm-ffi binding.
// One head of 512 dims per token: dims 0..447 as e4m3 (448 B) + dims 448..511 as bf16 (128 B) = 576 B of
// data, plus 8 B of UE8M0 scales (7 groups of 64 dims, 8th byte 0). A block of block_size tokens holds all
// token data first (token t at t*576), then all scales (token t at block_size*576 + t*8): block_size*584
// bytes, then any padding up to the block stride (a multiple of 16 bytes; Python's DSV4_K_CACHE says
// which strides a cache may have).
#pragma once

#include <cstdint>

namespace jitkv {
namespace dsv4 {

constexpr int kHeadDim = 512;
constexpr int kNopeDim = 448;                       // dims stored as e4m3
constexpr int kRopeDim = kHeadDim - kNopeDim;       // dims stored as bf16
constexpr int kGroupSize = 64;                      // dims per UE8M0 scale
constexpr int kNumGroups = kNopeDim / kGroupSize;   // 7 real scales
constexpr int kNopeBytes = kNopeDim;                // 448
constexpr int kRopeBytes = kRopeDim * 2;            // 128
constexpr int kDataBytes = kNopeBytes + kRopeBytes; // 576
constexpr int kScaleBytes = 8;                      // 7 scales + one 0 byte
constexpr int kTokenBytes = kDataBytes + kScaleBytes;  // 584
constexpr float kFp8Max = 448.0f;
constexpr float kMinAmax = 1e-4f;                   // floor of the group amax before the scale

// Bytes from a block's start to its scale region.
constexpr int64_t scale_offset(int64_t block_size) { return block_size * kDataBytes; }

static_assert(kNopeDim % kGroupSize == 0 && kDataBytes % 16 == 0, "16-byte aligned token data");

}  // namespace dsv4
}  // namespace jitkv
