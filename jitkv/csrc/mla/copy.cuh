// set_mla_kv_buffer's copy kernels ("auto": bytes moved unchanged). A row whose slot is < 0, ==
// skip_slot or >= num_slots is never written.
//  - latency kernel (the default; 16-byte aligned rows that fit in registers): one warp per row (per
//    16-byte register of the row at small n), the slot and the row loaded together
//    (set_mla_kv_buffer_latency_kernel).
//  - bulk kernels: each warp takes kRows consecutive rows per step (grid-stride loop): it reads their
//    slots first and drops a row before loading anything of it; then it loads all kept rows with
//    V-byte vectors (every load issued before any store) and writes them out:
//    - TMA path (SM90+): the lanes put the rows in the warp's shared-memory slots, fence the generic
//      proxy against the async proxy, and lane 0 issues ONE cp.async.bulk shared->global store per row
//      (nope + rope bytes; jitkv/cuda/tma.cuh). A slot is rewritten only after the previous step's bulk
//      stores have read it (wait_group.read, checked after the next loads are issued, so it costs
//      nothing).
//    - vector path (any arch, any alignment): the registers are stored straight to global memory.
// Programmatic dependent launch: see jitkv/cuda/launch.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/tma.cuh"
#include "jitkv/cuda/vec.cuh"
#include "mla/params.h"
#include "mla/rows.cuh"

namespace jitkv::mla {

// Loads vector register i (a compile-time constant after unrolling) of this lane, if the row has it.
template <int kNope, int kRope, int V>
__device__ __forceinline__ void load_vec(typename cuda::VecOf<V>::T& r, int i, const char* nope_row,
                                         const char* rope_row, int lane) {
  using S = RowShape<kNope, kRope, V>;
  using Vec = typename S::Vec;
  const int j = lane + 32 * i;
  // Only a register straddling nope/rope or the row's end needs the per-lane tests.
  if (32 * i + 31 < S::kNopeVecs || j < S::kNopeVecs) {
    r = *reinterpret_cast<const Vec*>(nope_row + static_cast<int64_t>(j) * V);
  } else if (32 * i + 31 < S::kVecs || j < S::kVecs) {
    r = *reinterpret_cast<const Vec*>(rope_row + static_cast<int64_t>(j - S::kNopeVecs) * V);
  }
}

template <int kNope, int kRope, int V>
__device__ __forceinline__ void store_vec(const typename cuda::VecOf<V>::T& r, int i, char* dst_row, int lane) {
  using S = RowShape<kNope, kRope, V>;
  const int j = lane + 32 * i;
  if (32 * i + 31 < S::kVecs || j < S::kVecs) reinterpret_cast<typename S::Vec*>(dst_row)[j] = r;
}

// One row held in registers by a warp (RowShape::kInRegisters).
template <int kNope, int kRope, int V>
struct RowRegs {
  using S = RowShape<kNope, kRope, V>;
  typename S::Vec r[S::kIters];

  __device__ __forceinline__ void load(const char* nope_row, const char* rope_row, int lane) {
#pragma unroll
    for (int i = 0; i < S::kIters; ++i) load_vec<kNope, kRope, V>(r[i], i, nope_row, rope_row, lane);
  }
  __device__ __forceinline__ void store(char* dst_row, int lane) const {
#pragma unroll
    for (int i = 0; i < S::kIters; ++i) store_vec<kNope, kRope, V>(r[i], i, dst_row, lane);
  }
};

// Copies one row of any length from (nope_row, rope_row) to dst_row (global or shared) in chunks.
template <int kNope, int kRope, int V>
__device__ __forceinline__ void copy_row_chunked(const char* nope_row, const char* rope_row, char* dst_row, int lane) {
  using S = RowShape<kNope, kRope, V>;
#pragma unroll
  for (int c = 0; c < S::kIters; c += S::kChunk) {
    typename S::Vec r[S::kChunk];
#pragma unroll
    for (int k = 0; k < S::kChunk; ++k) {
      if (c + k < S::kIters) load_vec<kNope, kRope, V>(r[k], c + k, nope_row, rope_row, lane);
    }
#pragma unroll
    for (int k = 0; k < S::kChunk; ++k) {
      if (c + k < S::kIters) store_vec<kNope, kRope, V>(r[k], c + k, dst_row, lane);
    }
  }
}

// ---- TMA bulk store (SM90+) ----
template <int kBytes>
struct TmaSlot {
  static_assert(kBytes % 16 == 0, "cp.async.bulk moves multiples of 16 bytes");
  static constexpr int kStride = (kBytes + 127) / 128 * 128;  // 128-B aligned slots
};

template <bool kTma, int kWarps, int kRows, int kBytes>
struct WarpSmem {
  static constexpr int kSlot = TmaSlot<kBytes>::kStride;
  static constexpr int kTotal = kWarps * kRows * kSlot;
};
template <int kWarps, int kRows, int kBytes>
struct WarpSmem<false, kWarps, kRows, kBytes> {
  static constexpr int kSlot = 0;
  static constexpr int kTotal = 16;
};

// Writes the kept rows of this step out of the warp's shared-memory slots (TMA path). Lane 0 owns the
// bulk groups; the other lanes wait for it at __syncwarp before touching the slots.
template <int kBytes, int kRows>
__device__ __forceinline__ void bulk_store_rows(char* const (&dst)[kRows], const bool (&keep)[kRows],
                                                const char* warp_smem, int slot_stride, int lane) {
  cuda::fence_proxy_async_smem();
  __syncwarp();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      if (keep[k]) cuda::bulk_store(dst[k], warp_smem + k * slot_stride, kBytes);
    }
    cuda::bulk_commit();
  }
}

template <typename TLoc>
__device__ __forceinline__ bool load_slot(const MlaArgs& p, int64_t row, int64_t& slot) {
  slot = static_cast<int64_t>(cuda::load(static_cast<const TLoc*>(p.loc) + row));
  return keeps(p, slot);
}

// Latency kernel (the default for 16-byte aligned rows that fit in registers, at every n): kRowWarps
// warps per row (1, or one per 16-byte vector register of the row: 3 for 512+64 bf16) and a grid of
// exactly n * kRowWarps warps; warp w of a row moves the row's registers i with i % kRowWarps == w.
// After the PDL wait a warp issues its slot load and all of its 16-byte source loads at once (the
// sources of every row < n exist, padding rows included, so reading them is safe; they are written
// only when the slot is kept), lets the next kernel launch, and stores: one memory round trip from
// wait to store. Args: MlaRowArgs, or MlaArgs for the calls it cannot hold.
template <int kNope, int kRope, int kRowWarps, typename TLoc, typename Args>
__global__ void __launch_bounds__(32 * 8) set_mla_kv_buffer_latency_kernel(const __grid_constant__ Args p) {
  using S = RowShape<kNope, kRope, 16>;
  static_assert(kRowWarps == 1 || kRowWarps == S::kIters, "one warp per row or one per register");
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t row = kRowWarps == 1 ? warp : warp / kRowWarps;
  const int part = kRowWarps == 1 ? 0 : static_cast<int>(warp % kRowWarps);
  cuda::warm_params(p, p.n);
  if (row >= p.n) return;
  const char* nope = p.nope + row * nope_stride(p);
  const char* rope = p.rope + row * rope_stride(p);
  cuda::pdl_wait();  // loc and the sources may come from the previous kernel
  const int64_t slot = static_cast<int64_t>(cuda::load(static_cast<const TLoc*>(p.loc) + row));
  typename S::Vec r[S::kIters];
#pragma unroll
  for (int i = 0; i < S::kIters; ++i) {
    if (i % kRowWarps == part) load_vec<kNope, kRope, 16>(r[i], i, nope, rope, lane);
  }
  cuda::pdl_launch_dependents();  // after the loads (docs/performance.md "pdl_launch_dependents")
  if (keeps(p, slot)) {
    char* dst = p.dst + slot * dst_stride(p);
#pragma unroll
    for (int i = 0; i < S::kIters; ++i) {
      if (i % kRowWarps == part) store_vec<kNope, kRope, 16>(r[i], i, dst, lane);
    }
  }
}

template <int kNope, int kRope, int V, int kWarps, int kRows, bool kTma, typename TLoc>
__global__ void __launch_bounds__(kWarps * 32) set_mla_kv_buffer_kernel(const __grid_constant__ MlaArgs p) {
  using S = RowShape<kNope, kRope, V>;
  using Smem = WarpSmem<kTma, kWarps, kRows, S::kBytes>;
  static_assert(kRows == 1 || S::kInRegisters, "several rows per step only when a row fits in registers");
  __shared__ alignas(128) char smem[Smem::kTotal];

  // loc and the sources may come from the previous kernel; then let the next PDL kernel launch.
  cuda::warm_params(p, p.n);
  cuda::pdl_wait();
  cuda::pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  char* const warp_smem = smem + warp * kRows * Smem::kSlot;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps * kRows;
  for (int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kRows; row0 < p.n; row0 += step) {
    const char* nope = p.nope + row0 * p.nope_row_stride;
    const char* rope = p.rope + row0 * p.rope_row_stride;
    RowRegs<kNope, kRope, V> rows[S::kInRegisters ? kRows : 1];
    bool keep[kRows];
    char* dst[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      int64_t slot = -1;
      keep[k] = row0 + k < p.n && load_slot<TLoc>(p, row0 + k, slot);
      dst[k] = p.dst + (keep[k] ? slot : 0) * p.dst_row_stride;
    }
    if constexpr (S::kInRegisters) {
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        if (keep[k]) rows[k].load(nope + k * p.nope_row_stride, rope + k * p.rope_row_stride, lane);
      }
      if constexpr (kTma) {
        if (lane == 0) cuda::bulk_wait_smem_read();  // last step's bulk stores are done with the slots
        __syncwarp();
#pragma unroll
        for (int k = 0; k < kRows; ++k) {
          if (keep[k]) rows[k].store(warp_smem + k * Smem::kSlot, lane);
        }
        bulk_store_rows<S::kBytes, kRows>(dst, keep, warp_smem, Smem::kSlot, lane);
      } else {
#pragma unroll
        for (int k = 0; k < kRows; ++k) {
          if (keep[k]) rows[k].store(dst[k], lane);
        }
      }
    } else if (keep[0]) {
      if constexpr (kTma) {
        if (lane == 0) cuda::bulk_wait_smem_read();
        __syncwarp();
        copy_row_chunked<kNope, kRope, V>(nope, rope, warp_smem, lane);
        bulk_store_rows<S::kBytes, kRows>(dst, keep, warp_smem, Smem::kSlot, lane);
      } else {
        copy_row_chunked<kNope, kRope, V>(nope, rope, dst[0], lane);
      }
    }
  }
  if constexpr (kTma) {
    if (lane == 0) cuda::bulk_wait_smem_read();  // shared memory must outlive the bulk reads of it
  }
}

}  // namespace jitkv::mla
