// gather_mla_cache's CUDA kernel (the rule it runs: entry.h).
//
// One warp per kTok output rows (CTAs of kWarps warps, a grid-stride loop over tiles of kWarps * kTok
// consecutive rows). Lane k < kTok resolves row t0 + k (entry_offset) and the warp shares the results;
// then every lane issues its loads of all kTok entries before the first conversion, and writes 16-byte
// output vectors: output vector j (16 bytes) of a row is lane j % 32's register j / 32. A copy reads 16
// bytes per vector, a per-tensor fp8 format 8 (8 values), fp8_ds_mla 8 e4m3 bytes (nope) or 16 bytes
// (rope) plus the record's 16 bytes of tile scales, read once per lane and row (one broadcast
// transaction per warp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jitkv/codes.h"
#include "jitkv/cuda/dequant.cuh"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/vec.cuh"
#include "jitkv/cuda/warp.cuh"
#include "mla_gather/entry.h"
#include "mla_gather/params.h"

namespace jitkv::mla_gather {

// The cache is read once: streaming loads (evict-first), so the output rows the next kernel reads stay in L2.
__device__ __forceinline__ uint4 ld16(const char* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 ld8(const char* p) {
  const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
  return make_uint4(v.x, v.y, 0u, 0u);
}

// One row held by a warp: raw[i] is output vector j = lane + 32 i as loaded from the cache entry.
template <KvFormat kFormat, int kOutBytes>
struct RowRegs {
  static_assert(kOutBytes % 16 == 0, "output rows of whole 16-byte vectors");
  static constexpr int kVecs = kOutBytes / 16;
  static constexpr int kIters = (kVecs + 31) / 32;
  static constexpr int kNopeVecs = kFormat == KvFormat::kDsMla ? DsMla::kNope / 8 : kVecs;  // vectors from 8 fp8 bytes
  static_assert(kFormat != KvFormat::kDsMla || kOutBytes == 2 * kDsMlaOutDims, "fp8_ds_mla rows are 576 bf16");
  static_assert(kFormat != KvFormat::kDsMla ||
                    (DsMla::kTile % 8 == 0 && DsMla::kScaleOffset % 16 == 0 && DsMla::kRopeOffset % 16 == 0),
                "fp8_ds_mla record: 16-byte aligned parts, tiles of whole vectors");
  uint4 raw[kIters];
  uint4 scales;  // fp8_ds_mla: the record's tile scales (up to 4 fp32)

  __device__ __forceinline__ void load(const char* entry, bool valid, int lane) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int j = lane + 32 * i;
      raw[i] = make_uint4(0u, 0u, 0u, 0u);
      if (!valid || j >= kVecs) continue;
      if constexpr (kFormat == KvFormat::kCopy) {
        raw[i] = ld16(entry + 16 * j);
      } else if constexpr (kFormat == KvFormat::kDsMla) {
        raw[i] = j < kNopeVecs ? ld8(entry + 8 * j) : ld16(entry + DsMla::kRopeOffset + 16 * (j - kNopeVecs));
      } else {
        raw[i] = ld8(entry + 8 * j);
      }
    }
    if constexpr (kFormat == KvFormat::kDsMla) {
      static_assert(DsMla::kNope / DsMla::kTile <= 4, "at most 4 tile scales (one 16-byte load)");
      scales = valid ? ld16(entry + DsMla::kScaleOffset) : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  // Converts and writes the row; a zero row (valid false) is written as zeros whatever the scale.
  __device__ __forceinline__ void store(char* out_row, bool valid, float scale, int lane) const {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int j = lane + 32 * i;
      if (j >= kVecs) continue;
      uint4 v = raw[i];
      if constexpr (kFormat == KvFormat::kE4M3 || kFormat == KvFormat::kE5M2) {
        v = cuda::dequant8<kFormat == KvFormat::kE5M2>(v.x, v.y, scale);
      } else if constexpr (kFormat == KvFormat::kDsMla) {
        if (j < kNopeVecs) v = cuda::dequant8<false>(v.x, v.y, tile_scale(j * 8 / DsMla::kTile));
      }
      if (!valid) v = make_uint4(0u, 0u, 0u, 0u);
      reinterpret_cast<uint4*>(out_row)[j] = v;
    }
  }

  __device__ __forceinline__ float tile_scale(int tile) const {
    const uint32_t s = tile == 0 ? scales.x : tile == 1 ? scales.y : tile == 2 ? scales.z : scales.w;
    return __uint_as_float(s);
  }
};

constexpr int kWarps = 4;  // warps per CTA
constexpr int kTok = 2;    // output rows per warp and step

template <KvFormat kFormat, int kOutBytes>
__global__ void __launch_bounds__(kWarps * 32) gather_mla_cache_kernel(const __grid_constant__ GatherParams p) {
  static_assert(kTok <= 32, "one lane resolves each row of a warp");
  using Row = RowRegs<kFormat, kOutBytes>;
  cuda::warm_params(p, p.rows);
  cuda::pdl_wait();  // the cache, the index tensors and the scale may come from the previous kernel
  cuda::pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float scale = 1.0f;
  if constexpr (kFormat == KvFormat::kE4M3 || kFormat == KvFormat::kE5M2) {
    scale = p.scale_ptr ? cuda::load(p.scale_ptr) : p.scale_value;
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps * kTok;
  for (int64_t t0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kTok; t0 < p.rows; t0 += step) {
    int64_t mine = kNotWritten;
    if (lane < kTok && t0 + lane < p.rows) mine = entry_offset(p, t0 + lane);
    int64_t off[kTok];
    Row r[kTok];
#pragma unroll
    for (int k = 0; k < kTok; ++k) {  // every load of the warp in flight before the first conversion
      off[k] = cuda::shfl64(mine, k);
      r[k].load(p.cache + (off[k] >= 0 ? off[k] : 0), off[k] >= 0, lane);
    }
#pragma unroll
    for (int k = 0; k < kTok; ++k) {
      if (off[k] != kNotWritten) r[k].store(p.out + (t0 + k) * p.out_row_stride, off[k] >= 0, scale, lane);
    }
  }
}

}  // namespace jitkv::mla_gather
