// store_cache on CUDA: scatter K and V rows of n tokens into flat / paged-NHD / paged-HND caches in
// one launch, copying bytes ("auto") or quantizing bf16/fp16/fp32 to FP8 on the way.
//
// Algorithm. A token's K row (and V row) is cut into chunks of 32 * kUnroll destination vectors of
// kVec bytes (kVec = 16 in specialised builds). One warp owns one (token, chunk): it reads the slot,
// applies skip_slot / loc_map, issues every load of its K and V chunk (lane i takes vectors i, i+32,
// ...), then every store. Vector i of a row lies in head i / head_vecs at byte (i % head_vecs) * kVec
// of that head, so dense rows and per-head strided layouts (HND caches, fused-qkv source views) share
// one code path; every stride is in bytes.
//
// Two kernels per build. The latency kernel: one vector per lane and side, every address computed
// before the PDL wait, the slot and the source loads issued together after it (padding rows' sources
// are read, never written), and (fp8) K and V in separate warps, so a lone warp's chain from slot to
// store is a few dozen instructions. Beyond kLatencyWarpsPerSM warps per SM (store_cache_cuda.cu) the
// bulk kernel: 2 KB of source per warp and side (H=8 x D=128 bf16 rows are one chunk per token,
// larger rows split across warps, grid.y = chunks per token), few registers, the slot first so that
// skipped rows cost no reads.
//
// FP8: stored = cvt.rn.satfinite(x / scale): a true fp32 division (bit-identical to __fdiv_rn), then
// the hardware round-to-nearest-even conversion, which saturates finite overflow and +-inf to +-max
// (the same bytes as clamp(-max, max) first) and maps NaN to 0x7F. The latency kernel divides without
// a branch per element (Divider); the bulk kernel calls __fdiv_rn per element (fewer registers).
// Measured on H200 (H=8, D=128, e4m3): n = 1 latency kernel 1.3 us, bulk kernel 3.1 us; n = 131072
// bulk kernel 203 us, with the latency kernel's division 225 us.
//
// This file has a host-visible part (parameter block, launcher declaration) for the g++-compiled
// binding and a device part for nvcc.
#pragma once

#include <stdint.h>

namespace jitkv {
namespace store_cache {

enum class SrcType : int { kBytes = 0, kBF16 = 1, kF16 = 2, kF32 = 3 };  // kBytes: plain copy
enum class Fp8 : int { kNone = 0, kE4M3 = 1, kE5M2 = 2 };                // values of jitkv::KVDtype

// Source bytes per destination byte, and destination vectors one lane moves per side and chunk: bulk
// chunks carry 2 KB of source per warp and side (8 independent 16-byte loads per lane for K+V);
// latency kernels move one vector per lane and side.
constexpr int src_ratio(SrcType s, Fp8 f) { return f == Fp8::kNone ? 1 : s == SrcType::kF32 ? 4 : 2; }
constexpr int chunk_unroll(SrcType s, Fp8 f, bool bulk) { return bulk ? 4 / src_ratio(s, f) : 1; }
constexpr int kMaxWarpsPerBlock = 8;
// Latency kernels of fp8 builds with K and V heads of one size give K and V separate warps
// (grid.z = 2; see store_cache_kernel).
constexpr bool split_sides(Fp8 f, int k_head_bytes, int v_head_bytes, bool bulk) {
  return f != Fp8::kNone && k_head_bytes == v_head_bytes && !bulk;
}

// One of K / V. Strides in bytes; head_vecs / row_vecs count kVec-byte destination vectors.
struct Side {
  const char* src;
  int64_t src_stride_token, src_stride_head;
  char* dst;
  int64_t num_slots, block_size, dst_stride_block, dst_stride_token, dst_stride_head;
  int32_t head_vecs, row_vecs;
  int32_t block_shift;   // slot / block_size = (umulhi(slot, block_magic) + slot) >> block_shift
  uint32_t block_magic;  // (see the binding; exact for every slot of a cache the binding accepts)
  const float* scale_ptr;  // fp8: device scale, or nullptr to use `scale`
  float scale;
};

struct Params {
  Side k, v;
  const void* slots;
  const void* loc_map;  // nullptr: no translation
  int64_t loc_map_size, n, skip_slot;
  int32_t slot_i64, loc_i64;
  int32_t same_blocks;  // 1: K and V caches have the same block size (a slot's block and row agree)
};

}  // namespace store_cache
}  // namespace jitkv

// Launches on `stream` (a cudaStream_t) under a device guard for `device`; kVec = `vec` bytes (16 in
// specialised builds; 16/8/4/2/1 in the generic build). Returns nullptr, or the CUDA error string.
extern "C" const char* jitkv_store_cache_launch(const jitkv::store_cache::Params* p, int32_t vec,
                                                int32_t device, void* stream);

#if defined(__CUDACC__)

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"

namespace jitkv {
namespace store_cache {

// ---- N-byte register packs (words, so they stay in whole registers), loaded read-only (sources)
// and stored plainly (caches) ----
template <int N>
struct Pack {
  static_assert(N % 4 == 0, "packs are 1, 2 or a multiple of 4 bytes");
  uint32_t w[N / 4];
};
template <>
struct Pack<2> {
  uint16_t h;
};
template <>
struct Pack<1> {
  uint8_t b;
};

template <int N>
__device__ __forceinline__ Pack<N> load_pack(const char* p) {
  Pack<N> r;
  if constexpr (N >= 16) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(p) + i);
      r.w[4 * i] = q.x, r.w[4 * i + 1] = q.y, r.w[4 * i + 2] = q.z, r.w[4 * i + 3] = q.w;
    }
  } else if constexpr (N == 8) {
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
    r.w[0] = q.x, r.w[1] = q.y;
  } else if constexpr (N == 4) {
    r.w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else if constexpr (N == 2) {
    r.h = __ldg(reinterpret_cast<const unsigned short*>(p));
  } else {
    r.b = __ldg(reinterpret_cast<const unsigned char*>(p));
  }
  return r;
}

template <int N>
__device__ __forceinline__ void store_pack(char* p, const Pack<N>& v) {
  if constexpr (N >= 16) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i)
      reinterpret_cast<uint4*>(p)[i] = make_uint4(v.w[4 * i], v.w[4 * i + 1], v.w[4 * i + 2], v.w[4 * i + 3]);
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(v.w[0], v.w[1]);
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint32_t*>(p) = v.w[0];
  } else if constexpr (N == 2) {
    *reinterpret_cast<uint16_t*>(p) = v.h;
  } else {
    *reinterpret_cast<uint8_t*>(p) = v.b;
  }
}

using cuda::Divider;  // exact division by a warp-uniform scale (jitkv/cuda/fp8.cuh)

// ---- conversion of one destination vector ----
// kBulk: each element through __fdiv_rn, converted as soon as it is ready (short live ranges, few
// registers); otherwise every quotient of the vector through Divider at once (more registers, no
// branch per element, so a lone warp finishes fast).
template <SrcType kSrc, Fp8 kFp8, bool kBulk>
struct Convert {
  static constexpr bool kQuant = kFp8 != Fp8::kNone;
  static constexpr int kRatio = src_ratio(kSrc, kFp8);
  static constexpr int kUnroll = chunk_unroll(kSrc, kFp8, kBulk);
  static_assert(kQuant == (kSrc != SrcType::kBytes), "fp8 builds need a bf16/fp16/fp32 source type");
  static constexpr __nv_fp8_interpretation_t kFmt = kFp8 == Fp8::kE4M3 ? __NV_E4M3 : __NV_E5M2;

  // Element i of a source pack as float (exact for every source type).
  template <int M>
  __device__ __forceinline__ static float elem(const Pack<M>& in, int i) {
    if constexpr (kSrc == SrcType::kF32) {
      return __uint_as_float(in.w[i]);
    } else {
      uint32_t bits;
      if constexpr (M == 2) {
        bits = in.h;
      } else {
        bits = (in.w[i / 2] >> (16 * (i % 2))) & 0xffffu;
      }
      if constexpr (kSrc == SrcType::kBF16) return __uint_as_float(bits << 16);
      else return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    }
  }

  // Two quotients -> two fp8 bytes (the first in the low byte); cvt saturates and rounds to even.
  __device__ __forceinline__ static uint32_t fp8x2(float a, float b) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFmt);
  }

  // Every element through __fdiv_rn, converted as soon as it is ready (short live ranges).
  template <int N>
  __device__ __forceinline__ static Pack<N> divide_each(const Pack<N * kRatio>& in, float s) {
    Pack<N> out;
    if constexpr (N == 1) {
      out.b = __nv_cvt_float_to_fp8(__fdiv_rn(elem(in, 0), s), __NV_SATFINITE, kFmt);
    } else if constexpr (N == 2) {
      out.h = static_cast<uint16_t>(fp8x2(__fdiv_rn(elem(in, 0), s), __fdiv_rn(elem(in, 1), s)));
    } else {
#pragma unroll
      for (int j = 0; j < N / 4; ++j) {
        const uint32_t lo = fp8x2(__fdiv_rn(elem(in, 4 * j), s), __fdiv_rn(elem(in, 4 * j + 1), s));
        const uint32_t hi = fp8x2(__fdiv_rn(elem(in, 4 * j + 2), s), __fdiv_rn(elem(in, 4 * j + 3), s));
        out.w[j] = lo | (hi << 16);
      }
    }
    return out;
  }

  template <int N>
  __device__ __forceinline__ static Pack<N> run(const Pack<N * kRatio>& in, const Divider& div) {
    if constexpr (!kQuant) {
      return in;
    } else if constexpr (kBulk) {
      return divide_each<N>(in, div.s);
    } else {
      float q[N];
      bool slow = false;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float x = elem(in, i);
        q[i] = div.quick(x);
        slow |= !div.fast(x);
      }
      if (slow) return divide_each<N>(in, div.s);  // rare: the quotients above are dropped
      Pack<N> out;
      if constexpr (N == 1) {
        out.b = __nv_cvt_float_to_fp8(q[0], __NV_SATFINITE, kFmt);
      } else if constexpr (N == 2) {
        out.h = static_cast<uint16_t>(fp8x2(q[0], q[1]));
      } else {
#pragma unroll
        for (int j = 0; j < N / 4; ++j)
          out.w[j] = fp8x2(q[4 * j], q[4 * j + 1]) | (fp8x2(q[4 * j + 2], q[4 * j + 3]) << 16);
      }
      return out;
    }
  }
};

// ---- index handling ----
__device__ __forceinline__ int64_t load_index(const void* p, bool i64, int64_t i) {
  return i64 ? __ldg(static_cast<const long long*>(p) + i) : int64_t(__ldg(static_cast<const int*>(p) + i));
}

// ---- one side (K or V) of one chunk ----
// prepare() does everything that does not depend on the slot (vector offsets in the source and
// destination rows, the fp8 scale and its reciprocal); load() and store() then only add offsets to
// two row pointers. kPin (latency kernels) keeps prepare()'s work before the kernel's padding check,
// where it runs while the slot load is in flight: otherwise the compiler sinks it to its first use,
// after the slot, and a lone warp at a few cycles per instruction puts ~400 instructions on the
// latency of an n = 1 write. Bulk kernels leave it sunk (fewer live registers, more warps per SM).
// kHeadBytes: destination bytes per head when compiled in, 0 when taken from Side::head_vecs.
template <int kHeadBytes, int kVec, class Cv, bool kPin>
struct SideChunk {
  static constexpr int kSrcVec = kVec * Cv::kRatio;
  static constexpr int kUnroll = Cv::kUnroll;
  static_assert(kHeadBytes % kVec == 0, "head bytes must be a multiple of the vector width");

  Pack<kSrcVec> data[kUnroll];
  uint64_t src_addr[kUnroll];  // this lane's source vectors
  int64_t dst_off[kUnroll];    // and their byte offsets in the destination row
  int32_t count;               // vectors u < count lie in the row (after load(): are written)
  Divider div;                 // fp8 only

  __device__ __forceinline__ static uint32_t head_vecs(const Side& s) {
    return kHeadBytes ? uint32_t(kHeadBytes / kVec) : uint32_t(s.head_vecs);
  }

  // Byte offset in its row of vector i (of vec_bytes bytes): head i / hv, heads head_stride apart.
  __device__ __forceinline__ static int64_t vec_offset(uint32_t i, uint32_t hv, int64_t head_stride, int vec_bytes) {
    const uint32_t h = i / hv;
    return int64_t(h) * head_stride + int64_t(i - h * hv) * vec_bytes;
  }

  // Addresses only (no memory access): latency kernels call it before the PDL wait.
  __device__ __forceinline__ void prepare(const Side& s, int64_t token, uint32_t first) {
    const uint32_t hv = head_vecs(s), row_vecs = uint32_t(s.row_vecs);
    const uint64_t src_row = reinterpret_cast<uint64_t>(s.src) + token * s.src_stride_token;
    count = first < row_vecs ? min(kUnroll, int32_t((row_vecs - first + 31) / 32)) : 0;
    if constexpr (kPin) asm volatile("" : "+r"(count));
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = first + 32 * u;
      src_addr[u] = src_row + vec_offset(i, hv, s.src_stride_head, kSrcVec);
      dst_off[u] = vec_offset(i, hv, s.dst_stride_head, kVec);
      if constexpr (kPin) asm volatile("" : "+l"(src_addr[u]), "+l"(dst_off[u]));
    }
  }

  // fp8: the scale (a device scale may come from the previous kernel: after the PDL wait).
  __device__ __forceinline__ void load_scale(const Side& s) {
    if constexpr (Cv::kQuant) div = Divider(s.scale_ptr ? __ldg(s.scale_ptr) : s.scale);
  }

  __device__ __forceinline__ void load(bool ok) {
    if (!ok) count = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u < count) data[u] = load_pack<kSrcVec>(reinterpret_cast<const char*>(src_addr[u]));
  }

  __device__ __forceinline__ void store(char* row) const {
    if (count == 0) return;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u < count) store_pack<kVec>(row + dst_off[u], Cv::template run<kVec>(data[u], div));
  }
};

// The destination geometry of one side. A slot's row is dst + slot * stride_token + block * block_adj
// (block_adj = stride_block - block_size * stride_token; 0 for flat caches), so that slot * stride_token
// is computed while the block number is: a lone warp's chain from slot to store stays short.
struct DstRegs {
  char* dst;
  int64_t stride_token, block_adj;
  uint32_t block_magic;
  int32_t block_shift;

  __device__ __forceinline__ static DstRegs of(const Side& s) {
    return DstRegs{s.dst, s.dst_stride_token, s.dst_stride_block - s.block_size * s.dst_stride_token, s.block_magic,
                   s.block_shift};
  }

  // slot / block_size for a slot in [0, num_slots), without a branch or a division: exact for every
  // slot of a cache the binding accepts (see set_block_division there).
  __device__ __forceinline__ uint64_t block(int64_t slot) const {
    return (uint64_t(__umulhi(uint32_t(slot), block_magic)) + uint64_t(slot)) >> block_shift;
  }

  __device__ __forceinline__ char* row(int64_t slot, uint64_t blk) const {
    return dst + (slot * stride_token + int64_t(blk) * block_adj);
  }
};

// Byte address of `slot`'s row in one cache (slot in [0, num_slots)).
__device__ __forceinline__ char* slot_row(const Side& s, int64_t slot) {
  const DstRegs d = DstRegs::of(s);
  return d.row(slot, d.block(slot));
}

// Destination slot of a slot_mapping entry, or -1 when the row is skipped (padding, skip_slot, outside
// loc_map or mapped below 0; skip_slot is compared before the translation).
__device__ __forceinline__ int64_t resolve_slot(const Params& p, int64_t slot) {
  if (slot < 0 || slot == p.skip_slot) return -1;
  if (p.loc_map == nullptr) return slot;
  if (slot >= p.loc_map_size) return -1;  // never read out of bounds
  return load_index(p.loc_map, p.loc_i64, slot);
}

// Latency kernel: one vector per lane and side. Addresses are computed before the PDL wait (they
// read only the parameter block); after it a warp issues the slot load and its source loads together
// (every token < n has source rows, padding included, so reading them is safe; they are written only
// for a kept slot), lets the next kernel launch, then resolves the slot and stores.
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcType kSrc, Fp8 kFp8>
__device__ __forceinline__ void latency_write(const Params& p) {
  using Cv = Convert<kSrc, kFp8, false>;
  cuda::warm_params(p);
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const uint32_t first = blockIdx.y * 32 + (threadIdx.x & 31);
  constexpr bool kSplit = split_sides(kFp8, kKHeadBytes, kVHeadBytes, false);
  // With split sides (grid.z = 2) blockIdx.z picks K or V: one code path with the side picked by
  // data (with two, the compiler computes both).
  const Side& first_side = kSplit && blockIdx.z ? p.v : p.k;
  SideChunk<kKHeadBytes, kVec, Cv, true> k;
  SideChunk<kVHeadBytes, kVec, Cv, true> v;
  k.prepare(first_side, token, first);
  if constexpr (!kSplit) v.prepare(p.v, token, first);
  if (token >= p.n) return;
  cuda::pdl_wait();  // sources, indices and device scales may come from the previous kernel
  const int64_t entry = load_index(p.slots, p.slot_i64, token);
  k.load(true);
  if constexpr (!kSplit) v.load(true);
  cuda::pdl_launch_dependents();  // after the loads (see set_mla_kv_buffer.cuh)
  k.load_scale(first_side);
  if constexpr (!kSplit) v.load_scale(p.v);
  int64_t slot = entry;
  if (p.loc_map != nullptr) slot = resolve_slot(p, entry);
  else if (entry == p.skip_slot) return;  // padding (< 0) fails the unsigned range check below
  // Padding, skipped and out-of-range slots are never written (K and V have the same slot count).
  if (uint64_t(slot) >= uint64_t(p.k.num_slots)) return;
  const DstRegs dk = DstRegs::of(first_side);
  uint64_t blk = dk.block(slot);
  k.store(dk.row(slot, blk));
  if constexpr (!kSplit) {
    const DstRegs dv = DstRegs::of(p.v);
    if (p.same_blocks == 0) blk = dv.block(slot);
    v.store(dv.row(slot, blk));
  }
}

// Bulk kernel: the slot first, then a padding or out-of-range row is dropped before anything of it
// is read (at large n every skipped row saves its bytes).
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcType kSrc, Fp8 kFp8>
__device__ __forceinline__ void bulk_write(const Params& p) {
  using Cv = Convert<kSrc, kFp8, true>;
  cuda::pdl_wait();  // sources and indices may come from the previous kernel
  cuda::pdl_launch_dependents();
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (token >= p.n) return;
  const int64_t entry = load_index(p.slots, p.slot_i64, token);
  const uint32_t first = blockIdx.y * (32 * Cv::kUnroll) + (threadIdx.x & 31);
  SideChunk<kKHeadBytes, kVec, Cv, false> k;
  SideChunk<kVHeadBytes, kVec, Cv, false> v;
  k.prepare(p.k, token, first);
  v.prepare(p.v, token, first);
  const int64_t slot = resolve_slot(p, entry);
  if (slot < 0) return;  // padding: nothing else is read
  k.load_scale(p.k);
  v.load_scale(p.v);
  k.load(slot < p.k.num_slots);  // out-of-range slots are never written
  v.load(slot < p.v.num_slots);
  k.store(slot_row(p.k, slot));
  v.store(slot_row(p.v, slot));
}

// grid = (ceil(n / warps_per_block), chunks, sides), block = 32 * warps_per_block; one warp per
// (token, chunk), writing K and V. With split_sides (sides = 2), one warp per (token, chunk, side),
// which halves each warp's fp8 conversion chain; bf16 copies stay on one warp (measured slower split).
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcType kSrc, Fp8 kFp8, bool kBulk>
__global__ void __launch_bounds__(32 * kMaxWarpsPerBlock)
    store_cache_kernel(const __grid_constant__ Params p) {
  if constexpr (kBulk) {
    bulk_write<kKHeadBytes, kVHeadBytes, kVec, kSrc, kFp8>(p);
  } else {
    latency_write<kKHeadBytes, kVHeadBytes, kVec, kSrc, kFp8>(p);
  }
}

}  // namespace store_cache
}  // namespace jitkv

#endif  // __CUDACC__
