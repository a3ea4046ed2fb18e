// How set_mla_kv_buffer's kernels see a row: its vectors (RowShape) and, for either parameter block
// (the call's or the compact one), the row strides and the slot test.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jitkv/cuda/vec.cuh"
#include "mla/params.h"

namespace jitkv::mla {

// Vector j (of V bytes) of a row is handled by lane j % 32 as its register j / 32; vectors
// [0, kNopeVecs) come from k_nope, the rest from k_rope; vector j lands at byte j * V of the
// destination row. A lane holds at most 128 bytes (16 registers for sub-word vectors) of a row at
// once; longer rows go in chunks, all loads of a chunk issued before its stores.
template <int kNope, int kRope, int V>
struct RowShape {
  static_assert(kNope % V == 0 && kRope % V == 0, "vector width must divide nope and rope bytes");
  using Vec = typename cuda::VecOf<V>::T;
  static constexpr int kNopeVecs = kNope / V;
  static constexpr int kVecs = (kNope + kRope) / V;
  static constexpr int kIters = (kVecs + 31) / 32;
  static constexpr int kMaxChunk = V >= 4 ? 128 / V : 16;
  static constexpr int kChunk = kMaxChunk < kIters ? kMaxChunk : kIters;
  static constexpr bool kInRegisters = kChunk == kIters;  // whole row in registers at once
  static constexpr int kBytes = kNope + kRope;
};

// Row strides in bytes and the slot test of either parameter block: padding (slot < 0) fails the
// unsigned range check; out-of-range slots and skip_slot are never written.
__device__ __forceinline__ int64_t nope_stride(const MlaArgs& p) { return p.nope_row_stride; }
__device__ __forceinline__ int64_t rope_stride(const MlaArgs& p) { return p.rope_row_stride; }
__device__ __forceinline__ int64_t dst_stride(const MlaArgs& p) { return p.dst_row_stride; }
__device__ __forceinline__ bool keeps(const MlaArgs& p, int64_t slot) {
  return slot != p.skip_slot && static_cast<uint64_t>(slot) < static_cast<uint64_t>(p.num_slots);
}
__device__ __forceinline__ int64_t nope_stride(const MlaRowArgs& p) { return int64_t{p.nope_stride16} * 16; }
__device__ __forceinline__ int64_t rope_stride(const MlaRowArgs& p) { return int64_t{p.rope_stride16} * 16; }
__device__ __forceinline__ int64_t dst_stride(const MlaRowArgs& p) { return int64_t{p.dst_stride8} * 8; }
__device__ __forceinline__ bool keeps(const MlaRowArgs& p, int64_t slot) {
  return static_cast<uint64_t>(slot) < static_cast<uint64_t>(p.num_slots);
}

}  // namespace jitkv::mla
