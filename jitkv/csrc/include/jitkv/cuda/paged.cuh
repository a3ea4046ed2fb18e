// Paged caches: slot s lives in block s / block_size, row s % block_size; its row is at
//   base + (s / block_size) * block_stride + (s % block_size) * token_stride
//   = base + s * token_stride + (s / block_size) * block_adj,  block_adj = block_stride - block_size * token_stride,
// so that s * token_stride is computed while the block number is, and a lone warp's chain from slot to
// store stays short. NHD and HND caches differ in their strides only (a head's stride is added to the
// row); a flat cache is block_size 1 with block_stride == token_stride (block_adj 0). The division by
// block_size is set up on the host once per call (block_division) and runs on the device as block_of:
// a multiply-high, an add and a shift, no branch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

}  // namespace cuda
}  // namespace jitkv
