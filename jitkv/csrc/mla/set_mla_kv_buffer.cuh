// set_mla_kv_buffer: kv_buffer[loc[i], :nope] = k_nope[i], kv_buffer[loc[i], nope:] = k_rope[i].
//
// The family's one parameter block (MlaParams) and its argument parser, shared by the CUDA binding
// (set_mla_kv_buffer_cuda.cu) and the CPU binding (set_mla_kv_buffer_cpu.cpp, which sees only this
// host part), then the CUDA kernels (compiled by nvcc only).
//
// A pure row scatter: the kernels only move bytes; a row whose slot is < 0, == skip_slot or
// >= num_slots is never written.
//  - latency kernel (the default; 16-byte aligned rows that fit in registers): one warp per row, the
//    slot and the row loaded together (set_mla_kv_buffer_latency_kernel).
//  - bulk kernels: each warp takes kRows consecutive rows per step (grid-stride loop): it reads their
//    slots first and drops a row before loading anything of it; then it loads all kept rows with
//    V-byte vectors (every load issued before any store) and writes them out:
//    - TMA path (SM90+): the lanes put the rows in the warp's shared-memory slots, fence the generic
//      proxy against the async proxy, and lane 0 issues ONE cp.async.bulk shared->global store per row
//      (nope + rope bytes). A slot is rewritten only after the previous step's bulk stores have read
//      it (wait_group.read, checked after the next loads are issued, so it costs nothing).
//    - vector path (any arch, any alignment): the registers are stored straight to global memory.
// Programmatic dependent launch: see jitkv/cuda/launch.cuh.
#pragma once

#include <cstdint>

#include "jitkv/check.h"

#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include "jitkv/cuda/launch.cuh"
#endif

namespace jitkv::mla {

// Shapes: kv_buffer [S, W] or [S, 1, W]; k_nope [n', nope] or [n', 1, nope]; k_rope likewise;
// W >= nope + rope; n' >= n = loc.numel(). One dtype everywhere (bf16, fp16, fp32, uint8, float8).
// Only the innermost dim must be contiguous: row strides are arbitrary and kept in bytes. The
// binding checks the device type (CPU vs CUDA); the parser checks that all tensors share one.
// The kernels read the fields up to skip_slot; the rest is for the host.
struct MlaParams {
  char* dst;
  const char* nope;
  const char* rope;
  const void* loc;
  int64_t n, num_slots, dst_row_stride, nope_row_stride, rope_row_stride, skip_slot;  // strides: bytes
  int64_t nope_bytes, rope_bytes;
  DLDevice device;
  bool loc_i64;
};

// A 2-D [rows, width] or 3-D [rows, 1, width] tensor: returns width.
inline int64_t row_width(const char* op, const char* name, const TensorView& t, const char* want) {
  if (t.ndim() == 2 || (t.ndim() == 3 && t.size(1) == 1)) return t.size(t.ndim() - 1);
  TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected shape " << want << ", got " << shape_str(t);
  return 0;
}

inline MlaParams parse_params(const char* op, const TensorView& kv_buffer, const TensorView& loc,
                              const TensorView& k_nope, const TensorView& k_rope, int64_t skip_slot) {
  const DLDataType dt = kv_buffer.dtype();
  if (!is_copy_dtype(dt)) {
    TVM_FFI_THROW(TypeError) << op << ": kv_buffer: expected dtype bfloat16, float16, float32, uint8, "
                             << "float8_e4m3fn or float8_e5m2, got " << dt;
  }
  const DLDevice dev = kv_buffer.device();
  check_device(op, "k_nope", k_nope, dev, "kv_buffer");
  check_device(op, "k_rope", k_rope, dev, "kv_buffer");
  check_device(op, "loc", loc, dev, "kv_buffer");
  check_same_dtype(op, "k_nope", k_nope, dt, "kv_buffer");
  check_same_dtype(op, "k_rope", k_rope, dt, "kv_buffer");

  const int64_t width = row_width(op, "kv_buffer", kv_buffer, "[num_slots, W] or [num_slots, 1, W]");
  const int64_t nope = row_width(op, "k_nope", k_nope, "[n, nope] or [n, 1, nope]");
  const int64_t rope = row_width(op, "k_rope", k_rope, "[n, rope] or [n, 1, rope]");
  check_last_dim_contiguous(op, "kv_buffer", kv_buffer);
  check_last_dim_contiguous(op, "k_nope", k_nope);
  check_last_dim_contiguous(op, "k_rope", k_rope);
  if (width < nope + rope) {
    TVM_FFI_THROW(ValueError) << op << ": kv_buffer: row width " << width << " is smaller than nope + rope = "
                              << nope << " + " << rope;
  }
  const bool loc_i64 = check_index(op, "loc", loc);
  const int64_t n = loc.numel();
  check_rows_at_least(op, "k_nope", k_nope, n, "loc");
  check_rows_at_least(op, "k_rope", k_rope, n, "loc");

  const int64_t es = elem_bytes(dt);
  MlaParams p;
  p.dst = data_ptr(kv_buffer);
  p.nope = data_ptr(k_nope);
  p.rope = data_ptr(k_rope);
  p.loc = data_ptr(loc);
  p.n = n;
  p.num_slots = kv_buffer.size(0);
  p.dst_row_stride = kv_buffer.stride(0) * es;
  p.nope_row_stride = k_nope.stride(0) * es;
  p.rope_row_stride = k_rope.stride(0) * es;
  p.skip_slot = skip_slot;
  p.nope_bytes = nope * es;
  p.rope_bytes = rope * es;
  p.device = dev;
  p.loc_i64 = loc_i64;
  return p;
}

#if defined(__CUDACC__)


template <int V> struct VecOf;
template <> struct VecOf<16> { using T = uint4; };
template <> struct VecOf<8> { using T = uint2; };
template <> struct VecOf<4> { using T = uint32_t; };
template <> struct VecOf<2> { using T = uint16_t; };
template <> struct VecOf<1> { using T = uint8_t; };

// Vector j (of V bytes) of a row is handled by lane j % 32 as its register j / 32; vectors
// [0, kNopeVecs) come from k_nope, the rest from k_rope; vector j lands at byte j * V of the
// destination row. A lane holds at most 128 bytes (16 registers for sub-word vectors) of a row at
// once; longer rows go in chunks, all loads of a chunk issued before its stores.
template <int kNope, int kRope, int V>
struct RowShape {
  static_assert(kNope % V == 0 && kRope % V == 0, "vector width must divide nope and rope bytes");
  using Vec = typename VecOf<V>::T;
  static constexpr int kNopeVecs = kNope / V;
  static constexpr int kVecs = (kNope + kRope) / V;
  static constexpr int kIters = (kVecs + 31) / 32;
  static constexpr int kMaxChunk = V >= 4 ? 128 / V : 16;
  static constexpr int kChunk = kMaxChunk < kIters ? kMaxChunk : kIters;
  static constexpr bool kInRegisters = kChunk == kIters;  // whole row in registers at once
  static constexpr int kBytes = kNope + kRope;
};

// Loads vector register i (a compile-time constant after unrolling) of this lane, if the row has it.
template <int kNope, int kRope, int V>
__device__ __forceinline__ void load_vec(typename VecOf<V>::T& r, int i, const char* nope_row,
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
__device__ __forceinline__ void store_vec(const typename VecOf<V>::T& r, int i, char* dst_row, int lane) {
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
__device__ __forceinline__ void copy_row_chunked(const char* nope_row, const char* rope_row, char* dst_row,
                                                 int lane) {
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

__device__ __forceinline__ void bulk_store(char* dst, const char* smem_src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(smem_src));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// Blocks until this thread's bulk groups have finished READING shared memory. That is all slot reuse
// and CTA exit need: the global writes complete by kernel end (before any PDL dependent's wait).
__device__ __forceinline__ void bulk_wait_smem_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}

__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

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
  fence_proxy_async_smem();  // each writer: its st.shared must be visible to the bulk copy engine
  __syncwarp();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      if (keep[k]) bulk_store(dst[k], warp_smem + k * slot_stride, kBytes);
    }
    bulk_commit();
  }
}

template <typename TLoc>
__device__ __forceinline__ bool load_slot(const MlaParams& p, int64_t row, int64_t& slot) {
  slot = static_cast<int64_t>(__ldg(static_cast<const TLoc*>(p.loc) + row));
  return slot >= 0 && slot != p.skip_slot && slot < p.num_slots;
}

// Latency kernel (the default for 16-byte aligned rows that fit in registers, at every n): one warp
// per row and a grid of exactly n warps. After the PDL wait a warp
// issues its slot load and all of its row's 16-byte source loads at once (the sources of every row
// < n exist, padding rows included, so reading them is safe; they are written only when the slot is
// kept), lets the next kernel launch, and stores: one memory round trip from wait to store.
template <int kNope, int kRope, typename TLoc>
__global__ void __launch_bounds__(32 * 8)
    set_mla_kv_buffer_latency_kernel(const __grid_constant__ MlaParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  cuda::warm_params(p);
  if (row >= p.n) return;
  const char* nope = p.nope + row * p.nope_row_stride;
  const char* rope = p.rope + row * p.rope_row_stride;
  cuda::pdl_wait();  // loc and the sources may come from the previous kernel
  const int64_t slot = static_cast<int64_t>(__ldg(static_cast<const TLoc*>(p.loc) + row));
  RowRegs<kNope, kRope, 16> r;
  r.load(nope, rope, lane);
  cuda::pdl_launch_dependents();  // after the loads: triggering before them measured 0.15 us slower
  // Padding (slot < 0) fails the unsigned range check; out-of-range slots are never written.
  if (slot != p.skip_slot && static_cast<uint64_t>(slot) < static_cast<uint64_t>(p.num_slots)) {
    r.store(p.dst + slot * p.dst_row_stride, lane);
  }
}

template <int kNope, int kRope, int V, int kWarps, int kRows, bool kTma, typename TLoc>
__global__ void __launch_bounds__(kWarps * 32)
    set_mla_kv_buffer_kernel(const __grid_constant__ MlaParams p) {
  using S = RowShape<kNope, kRope, V>;
  using Smem = WarpSmem<kTma, kWarps, kRows, S::kBytes>;
  static_assert(kRows == 1 || S::kInRegisters, "several rows per step only when a row fits in registers");
  __shared__ alignas(128) char smem[Smem::kTotal];

  // loc and the sources may come from the previous kernel; then let the next PDL kernel launch.
  cuda::warm_params(p);
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
        if (lane == 0) bulk_wait_smem_read();  // last step's bulk stores are done with the slots
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
        if (lane == 0) bulk_wait_smem_read();
        __syncwarp();
        copy_row_chunked<kNope, kRope, V>(nope, rope, warp_smem, lane);
        bulk_store_rows<S::kBytes, kRows>(dst, keep, warp_smem, Smem::kSlot, lane);
      } else {
        copy_row_chunked<kNope, kRope, V>(nope, rope, dst[0], lane);
      }
    }
  }
  if constexpr (kTma) {
    if (lane == 0) bulk_wait_smem_read();  // shared memory must outlive the bulk reads of it
  }
}

#endif  // __CUDACC__

}  // namespace jitkv::mla
