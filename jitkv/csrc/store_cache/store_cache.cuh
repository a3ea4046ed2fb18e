// store_cache: scatter K and V rows of n tokens into flat / paged-NHD / paged-HND caches, copying bytes
// ("auto") or quantizing bf16/fp16/fp32 to FP8 on the way (docs/design.md §2-§4).
//
// The family's parameter block (StoreCacheParams; the kernels get its StoreCacheArgs part) and its
// argument parser, shared by the CUDA binding (store_cache_cuda.cu) and the CPU binding
// (store_cache_cpu.cpp, which sees only this host part), then the CUDA kernels (compiled by nvcc only).
//
// Arguments. k, v: [n', H, D] or [n', H*D], n' >= n = slot_mapping.numel(). Caches: flat [S, H, D] /
// [S, H*D] or paged [num_blocks, block_size, H, D] (logical shape; an HND cache arrives as a permuted
// view, its strides carry the layout). Only the innermost dim must be contiguous; every other stride
// is honoured and kept in BYTES. Heads: H comes from whichever of the four tensors has a head dim (all
// must agree; none: H = 1); a 2-D tensor's row is split into H heads of D = row / H, contiguous inside
// the row. K and V may have different head dims but the same H. Slot s lives at
// dst + (s / block_size) * dst_stride_block + (s % block_size) * dst_stride_token, head h at
// + h * dst_stride_head; flat caches have block_size 1 and dst_stride_block == dst_stride_token == the
// row stride.
//
// kv_cache_dtype arrives as its code (jitkv/layouts.py FP8_CODES, whose values are the build arguments
// JITKV_COPY_CODE, JITKV_E4M3_CODE, JITKV_E5M2_CODE): a plain copy (cache dtype == source dtype;
// scales ignored), e4m3fn (max 448) or e5m2 (max 57344). fp8 caches are float8_e4m3fn / float8_e5m2
// (matching the code) or uint8; fp8 sources are bf16 / fp16 / fp32. (A String argument would cost
// ~0.6 s of build time in tvm-ffi's argument unpacking.)
//
// Scales (fp8 only). Convention with the Python wrapper:
//   * k_scale given as a tensor: float32, same device, 1 element (any shape) or [num_heads] (vLLM's
//     per-head quantization: head h of every row is divided by k_scale[h]); read by the kernel, so CUDA
//     graphs may replay with new values; k_scale_value is then ignored.
//   * k_scale given as a Python float: k_scale = None and k_scale_value = the float. It is rounded to
//     float32 and must be finite and > 0 after rounding (ValueError otherwise).
//   * k_scale not given (None): the wrapper passes k_scale = None and k_scale_value = -1.0 exactly;
//     that means "missing" (ValueError: fp8 needs a scale). No silent 1.0.
// Same for v. The quantized value is fp8(clamp(x / scale, -max, max)), division in float32.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "jitkv/check.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#endif

#if !defined(JITKV_COPY_CODE) || !defined(JITKV_E4M3_CODE) || !defined(JITKV_E5M2_CODE)
#error "store_cache needs -DJITKV_COPY_CODE, -DJITKV_E4M3_CODE and -DJITKV_E5M2_CODE (jitkv/layouts.py FP8_CODES)"
#endif

namespace jitkv::store_cache {

// The cache format: a plain copy or one of the fp8 formats (codes: see the top of this file).
enum class Fp8 : int { kNone = JITKV_COPY_CODE, kE4M3 = JITKV_E4M3_CODE, kE5M2 = JITKV_E5M2_CODE };

// One of K / V: its source rows and its cache. Strides in bytes.
struct Side {
  const char* src;
  int64_t src_stride_token, src_stride_head;
  char* dst;
  int64_t num_slots, block_size, dst_stride_block, dst_stride_token, dst_stride_head;
  int32_t head_vecs, row_vecs;  // CUDA: kVec-byte destination vectors per head and per row
  int32_t block_shift;          // CUDA: slot / block_size = (umulhi(slot, block_magic) + slot) >> block_shift
  uint32_t block_magic;         // (the CUDA binding sets these four; exact for every slot of a cache it accepts)
  const float* scale_ptr;       // fp8: a float32 tensor on the caches' device, or nullptr: `scale`
  float scale;
  int32_t scale_stride;         // elements from one head's scale to the next: 0 for one scale for all heads
};

// What a slot's row adds per block beyond slot * dst_stride_token: a slot's row is dst + slot *
// dst_stride_token + (slot / block_size) * block_adj (0 for flat caches). constexpr: the CUDA kernels
// call it too (--expt-relaxed-constexpr).
constexpr int64_t block_adj(const Side& s) { return s.dst_stride_block - s.block_size * s.dst_stride_token; }

// What the kernels read and all of their parameter block (every 64-byte line of it is warmed before
// the PDL wait: jitkv/cuda/launch.cuh warm_params); StoreCacheParams adds what only the host needs.
struct StoreCacheArgs {
  Side k, v;
  const void* slots;
  const void* loc_map;  // nullptr: no translation
  int64_t loc_map_size, n, skip_slot;
  int32_t slot_i64, loc_i64;
  int32_t same_blocks;  // 1: K and V caches have the same block size (a slot's block and row agree)
};

struct StoreCacheParams : StoreCacheArgs {
  int64_t num_heads, k_head_dim, v_head_dim;  // elements per head
  DLDataType src_dtype;                       // dtype of k and v
  Fp8 kv_dtype;
  DLDevice device;
};

inline bool is_fp8_source_dtype(DLDataType d) {
  return d.lanes == 1 && ((d.code == kDLFloat && (d.bits == 16 || d.bits == 32)) ||
                          (d.code == kDLBfloat && d.bits == 16));
}

inline Fp8 parse_kv_dtype(const char* op, int64_t code) {
  for (Fp8 f : {Fp8::kNone, Fp8::kE4M3, Fp8::kE5M2}) {
    if (code == static_cast<int64_t>(f)) return f;
  }
  TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: expected code " << JITKV_COPY_CODE << " (\"auto\"), "
                            << JITKV_E4M3_CODE << " (\"fp8_e4m3\") or " << JITKV_E5M2_CODE << " (\"fp8_e5m2\"), got "
                            << code;
  return Fp8::kNone;
}

inline const char* kv_dtype_name(Fp8 d) {
  return d == Fp8::kNone ? "auto" : d == Fp8::kE4M3 ? "fp8_e4m3" : "fp8_e5m2";
}

// Cache dtype against the source dtype and kv_cache_dtype (see the top of this file).
inline void check_cache_dtype(const char* op, const char* name, const TensorView& cache, DLDataType src, Fp8 kv) {
  DLDataType c = cache.dtype();
  if (kv == Fp8::kNone) {
    if (c == src) return;
    if (is_float8(c) && !is_float8(src)) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: \"auto\" needs " << name << " of the source "
                                << "dtype " << src << ", got an fp8 " << name << " (" << c << "); pass "
                                << "kv_cache_dtype=\"fp8_e4m3\" or \"fp8_e5m2\" with a scale to quantize";
    }
    TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected dtype " << src << " (the dtype of k, "
                             << "kv_cache_dtype=\"auto\"), got " << c;
  }
  uint8_t want = kv == Fp8::kE4M3 ? kDLFloat8_e4m3fn : kDLFloat8_e5m2;
  bool is_u8 = c.code == kDLUInt && c.bits == 8 && c.lanes == 1;
  if ((c.code == want && c.lanes == 1) || is_u8) return;
  if (is_float8(c)) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": dtype " << c << " does not match kv_cache_dtype=\""
                              << kv_dtype_name(kv) << "\" (expected "
                              << (want == kDLFloat8_e4m3fn ? "float8_e4m3fn" : "float8_e5m2") << " or uint8)";
  }
  TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: \"" << kv_dtype_name(kv) << "\" needs an fp8 "
                            << name << " (" << (want == kDLFloat8_e4m3fn ? "float8_e4m3fn" : "float8_e5m2")
                            << " or uint8), got " << c;
}

// Head structure of one tensor: heads = 0 when it has no head dim (2-D).
struct HeadShape {
  int64_t heads, head_dim, row;
};

inline HeadShape head_shape(const TensorView& t) {
  int64_t last = t.size(t.ndim() - 1);
  if (t.ndim() < 3) return {0, 0, last};
  int64_t h = t.size(t.ndim() - 2);
  return {h, last, h * last};
}

inline void check_rank(const char* op, const char* name, const TensorView& t, bool is_cache) {
  int nd = t.ndim();
  bool ok = is_cache ? (nd >= 2 && nd <= 4) : (nd == 2 || nd == 3);
  if (!ok) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected shape "
                              << (is_cache ? "[num_slots, H, D], [num_slots, H*D] or "
                                             "[num_blocks, block_size, H, D]"
                                           : "[n, H, D] or [n, H*D]")
                              << ", got " << shape_str(t);
  }
}

// (heads, head_dim, row) of one source/cache pair; heads = 0 when neither tensor has a head dim.
inline HeadShape pair_shape(const char* op, const char* src_name, const char* cache_name, const TensorView& src,
                            const TensorView& cache) {
  HeadShape s = head_shape(src), c = head_shape(cache);
  if (s.heads && c.heads && (s.heads != c.heads || s.head_dim != c.head_dim)) {
    TVM_FFI_THROW(ValueError) << op << ": " << cache_name << ": expected heads x head_dim = " << s.heads << " x "
                              << s.head_dim << " (from " << src_name << "), got " << c.heads << " x "
                              << c.head_dim;
  }
  if (s.row != c.row) {
    TVM_FFI_THROW(ValueError) << op << ": " << cache_name << ": expected a row of " << s.row
                              << " elements (H*D of " << src_name << "), got " << c.row << " (shape "
                              << shape_str(cache) << ")";
  }
  return s.heads ? s : c;
}

// The source fields of a side: [n', H, D] or [n', H*D] (heads of head_bytes, contiguous in the row).
inline void set_source(Side& s, const TensorView& t, int64_t head_bytes, int64_t es) {
  s.src = data_ptr(t);
  s.src_stride_token = t.stride(0) * es;
  s.src_stride_head = t.ndim() == 3 ? t.stride(1) * es : head_bytes;
}

// The cache fields of a side: paged 4-D, or flat (block_size 1).
inline void set_cache(Side& s, const TensorView& t, int64_t head_bytes) {
  const int64_t es = elem_bytes(t.dtype());
  s.dst = data_ptr(t);
  if (t.ndim() == 4) {
    s.num_slots = t.size(0) * t.size(1);
    s.block_size = t.size(1);
    s.dst_stride_block = t.stride(0) * es;
    s.dst_stride_token = t.stride(1) * es;
    s.dst_stride_head = t.stride(2) * es;
  } else {
    s.num_slots = t.size(0);
    s.block_size = 1;
    s.dst_stride_block = s.dst_stride_token = t.stride(0) * es;
    s.dst_stride_head = t.ndim() == 3 ? t.stride(1) * es : head_bytes;
  }
}

// Scale: tensor (pointer; one element, or [heads] per-head scales) or Python float (value; -1.0 exactly
// means "not given").
inline void parse_scale(const char* op, const char* name, const Optional<TensorView>& t, double value,
                        DLDevice dev, Fp8 kv, int64_t heads, Side& side) {
  side.scale_ptr = nullptr;
  side.scale = 1.0f;
  side.scale_stride = 0;
  if (t.has_value()) {
    const TensorView& s = t.value();
    check_device(op, name, s, dev, "k_cache");
    if (!(s.dtype().code == kDLFloat && s.dtype().bits == 32 && s.dtype().lanes == 1)) {
      TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected a float32 tensor, got " << s.dtype();
    }
    const bool per_head = s.ndim() == 1 && s.size(0) == heads && heads > 1;
    if (s.numel() != 1 && !per_head) {
      TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a 1-element tensor or [num_heads] = [" << heads
                                << "] per-head scales, got shape " << shape_str(s);
    }
    if (per_head && (s.stride(0) < 0 || s.stride(0) > INT32_MAX)) {
      TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a stride below 2^31, got " << s.stride(0);
    }
    side.scale_ptr = reinterpret_cast<const float*>(data_ptr(s));
    side.scale_stride = per_head ? static_cast<int32_t>(s.stride(0)) : 0;
    return;
  }
  if (value == -1.0) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": kv_cache_dtype=\"" << kv_dtype_name(kv)
                              << "\" requires a scale (a Python float or a 1-element float32 tensor, "
                              << "finite and > 0), got None";
  }
  float f = static_cast<float>(value);
  if (!(std::isfinite(f) && f > 0.0f)) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": must be finite and > 0 (as float32), got " << value;
  }
  side.scale = f;
}

// Checks every argument (device types are the bindings' business; the parser checks that all tensors
// share one device) and fills everything but the CUDA binding's fields of Side.
inline StoreCacheParams parse_params(const char* op, const TensorView& k, const TensorView& v,
                                     const TensorView& k_cache, const TensorView& v_cache,
                                     const TensorView& slot_mapping, const Optional<TensorView>& loc_map,
                                     int64_t skip_slot, int64_t kv_cache_dtype, const Optional<TensorView>& k_scale,
                                     const Optional<TensorView>& v_scale, double k_scale_value,
                                     double v_scale_value) {
  const Fp8 kv = parse_kv_dtype(op, kv_cache_dtype);
  const DLDevice dev = k_cache.device();
  check_device(op, "k", k, dev, "k_cache");
  check_device(op, "v", v, dev, "k_cache");
  check_device(op, "v_cache", v_cache, dev, "k_cache");
  check_device(op, "slot_mapping", slot_mapping, dev, "k_cache");

  // dtypes
  const DLDataType src = k.dtype();
  if (kv == Fp8::kNone ? !is_copy_dtype(src) : !is_fp8_source_dtype(src)) {
    TVM_FFI_THROW(TypeError) << op << ": k: expected dtype "
                             << (kv == Fp8::kNone ? "bfloat16, float16, float32, uint8, float8_e4m3fn or float8_e5m2"
                                                  : "bfloat16, float16 or float32 (quantized to fp8)")
                             << " with kv_cache_dtype=\"" << kv_dtype_name(kv) << "\", got " << src;
  }
  check_same_dtype(op, "v", v, src, "k");
  check_cache_dtype(op, "k_cache", k_cache, src, kv);
  check_cache_dtype(op, "v_cache", v_cache, src, kv);

  // shapes
  check_rank(op, "k", k, false);
  check_rank(op, "v", v, false);
  check_rank(op, "k_cache", k_cache, true);
  check_rank(op, "v_cache", v_cache, true);
  check_last_dim_contiguous(op, "k", k);
  check_last_dim_contiguous(op, "v", v);
  check_last_dim_contiguous(op, "k_cache", k_cache);
  check_last_dim_contiguous(op, "v_cache", v_cache);
  const HeadShape ks = pair_shape(op, "k", "k_cache", k, k_cache);
  const HeadShape vs = pair_shape(op, "v", "v_cache", v, v_cache);
  if (ks.heads && vs.heads && ks.heads != vs.heads) {
    TVM_FFI_THROW(ValueError) << op << ": v: expected " << ks.heads << " heads (as k), got " << vs.heads;
  }
  const int64_t heads = ks.heads ? ks.heads : vs.heads ? vs.heads : 1;
  if (ks.row % heads != 0) {
    TVM_FFI_THROW(ValueError) << op << ": k: row of " << ks.row << " elements does not split into the "
                              << heads << " heads of v";
  }
  if (vs.row % heads != 0) {
    TVM_FFI_THROW(ValueError) << op << ": v: row of " << vs.row << " elements does not split into the "
                              << heads << " heads of k";
  }
  const int64_t k_dim = ks.row / heads, v_dim = vs.row / heads;

  const bool slot_i64 = check_index(op, "slot_mapping", slot_mapping);
  const int64_t n = slot_mapping.numel();
  check_rows_at_least(op, "k", k, n, "slot_mapping");
  check_rows_at_least(op, "v", v, n, "slot_mapping");

  const int64_t src_es = elem_bytes(src);
  StoreCacheParams p{};
  set_source(p.k, k, k_dim * src_es, src_es);
  set_source(p.v, v, v_dim * src_es, src_es);
  set_cache(p.k, k_cache, k_dim * elem_bytes(k_cache.dtype()));
  set_cache(p.v, v_cache, v_dim * elem_bytes(v_cache.dtype()));
  if (p.k.num_slots != p.v.num_slots) {
    TVM_FFI_THROW(ValueError) << op << ": v_cache: expected " << p.k.num_slots << " slots (as k_cache), got "
                              << p.v.num_slots << " (shape " << shape_str(v_cache) << ")";
  }
  p.slots = data_ptr(slot_mapping);
  p.loc_map = nullptr;
  p.loc_map_size = 0;
  p.n = n;
  p.skip_slot = skip_slot;
  p.slot_i64 = slot_i64;
  p.loc_i64 = 0;
  if (loc_map.has_value()) {
    const TensorView& lm = loc_map.value();
    check_device(op, "loc_map", lm, dev, "k_cache");
    p.loc_i64 = check_index(op, "loc_map", lm);
    p.loc_map = data_ptr(lm);
    p.loc_map_size = lm.numel();
  }
  p.same_blocks = p.k.block_size == p.v.block_size;
  p.k.scale_ptr = p.v.scale_ptr = nullptr;
  p.k.scale = p.v.scale = 1.0f;
  p.k.scale_stride = p.v.scale_stride = 0;
  if (kv != Fp8::kNone) {
    parse_scale(op, "k_scale", k_scale, k_scale_value, dev, kv, heads, p.k);
    parse_scale(op, "v_scale", v_scale, v_scale_value, dev, kv, heads, p.v);
  }
  p.num_heads = heads;
  p.k_head_dim = k_dim;
  p.v_head_dim = v_dim;
  p.src_dtype = src;
  p.kv_dtype = kv;
  p.device = dev;
  return p;
}

// What a binding returns: kDone after the write (every CPU call), or kNeedsAnyAlignment from a 16-byte
// CUDA build given a view it cannot address with 16-byte vectors, before anything runs; the op then
// dispatches the any-alignment build (ops/store_cache.py).
enum Status : int64_t { kDone = 0, kNeedsAnyAlignment = 1 };

// The kv_cache_dtype "auto" entry point of a binding `kFull` (the CPU or CUDA store_cache): its first
// seven arguments, no fp8 ones. The decode path calls it eagerly; tvm-ffi converts each argument on
// every call (the benchmark's "bare tvm-ffi binding" row measures it).
using StoreCacheFn = int64_t (*)(TensorView, TensorView, TensorView, TensorView, TensorView, Optional<TensorView>,
                                 int64_t, int64_t, Optional<TensorView>, Optional<TensorView>, double, double);
template <StoreCacheFn kFull>
int64_t store_cache_copy(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache, TensorView slot_mapping,
                         Optional<TensorView> loc_map, int64_t skip_slot) {
  return kFull(k, v, k_cache, v_cache, slot_mapping, loc_map, skip_slot, static_cast<int64_t>(Fp8::kNone),
               Optional<TensorView>(), Optional<TensorView>(), -1.0, -1.0);
}

#if defined(__CUDACC__)

// ---- CUDA kernels ----
//
// Algorithm. A token's K row (and V row) is cut into chunks of 32 * kUnroll destination vectors of
// kVec bytes (kVec = 16 in specialised builds). One warp owns one (token, chunk): it reads the slot,
// applies skip_slot / loc_map, issues every load of its K and V chunk (lane i takes vectors i, i+32,
// ...), then every store. Vector i of a row lies in head i / head_vecs at byte (i % head_vecs) * kVec
// of that head, so dense rows and per-head strided layouts (HND caches, fused-qkv source views) share
// one code path; every stride is in bytes.
//
// Two kernels per build, and the latency kernel's compact row form (row kernels, below). The latency
// kernel: one vector per lane and side, every address computed
// before the PDL wait, the slot and the source loads issued together after it (padding rows' sources
// are read, never written), and (fp8) K and V in separate warps, so a lone warp's chain from slot to
// store is a few dozen instructions. Beyond kLatencyWarpsPerSM warps per SM (store_cache_cuda.cu) the
// bulk kernel: 2 KB of source per warp and side (H=8 x D=128 bf16 rows are one chunk per token,
// larger rows split across warps, grid.y = chunks per token), few registers, the slot first so that
// skipped rows cost no reads.
//
// FP8: stored = cvt.rn.satfinite(x / scale): a true fp32 division (bit-identical to __fdiv_rn), then
// the hardware round-to-nearest-even conversion, which saturates finite overflow and +-inf to +-max
// (the same bytes as clamp(-max, max) first) and maps NaN to 0x7F. The latency kernels divide without
// a branch (Divider::quick); the bulk kernel calls __fdiv_rn per element (fewer registers).
// Measured on H200 (H=8, D=128, e4m3): n = 1 latency kernel 1.3 us, bulk kernel 3.1 us; n = 131072
// bulk kernel 203 us, with the latency kernel's division 225 us.
//
// Per-head scales: a lane's vector lies in one head (head bytes are multiples of the vector width), so
// each lane divides by the scale of its vector's head: its offset is computed with the addresses, the
// scale loaded where the shared one was. The row kernels take contiguous per-head scales through their
// scale word (RowFp8Args); the latency and bulk kernels have per-head forms (kPerHead, fp8 builds) for
// the other calls, and their one-scale forms are compiled without any of it.
// python -m jitkv.benchmark --op store_cache has the "fp8 e4m3 per-head" rows.

enum class SrcType : int { kBytes = 0, kBF16 = 1, kF16 = 2, kF32 = 3 };  // kBytes: plain copy

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
      const uint4 q = cuda::load(reinterpret_cast<const uint4*>(p) + i);
      r.w[4 * i] = q.x, r.w[4 * i + 1] = q.y, r.w[4 * i + 2] = q.z, r.w[4 * i + 3] = q.w;
    }
  } else if constexpr (N == 8) {
    const uint2 q = cuda::load(reinterpret_cast<const uint2*>(p));
    r.w[0] = q.x, r.w[1] = q.y;
  } else if constexpr (N == 4) {
    r.w[0] = cuda::load(reinterpret_cast<const unsigned int*>(p));
  } else if constexpr (N == 2) {
    r.h = cuda::load(reinterpret_cast<const unsigned short*>(p));
  } else {
    r.b = cuda::load(reinterpret_cast<const unsigned char*>(p));
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

using cuda::Divider;  // exact division by a scale, one per lane (jitkv/cuda/fp8.cuh)

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

  // Every element through Divider::quick.
  template <int N>
  __device__ __forceinline__ static Pack<N> divide_quick(const Pack<N * kRatio>& in, const Divider& div) {
    float q[N];
#pragma unroll
    for (int i = 0; i < N; ++i) q[i] = div.quick(elem(in, i));
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

  template <int N>
  __device__ __forceinline__ static Pack<N> run(const Pack<N * kRatio>& in, const Divider& div) {
    if constexpr (!kQuant) {
      return in;
    } else if constexpr (kBulk) {
      return divide_each<N>(in, div.scale);
    } else {
      return divide_quick<N>(in, div);
    }
  }
};

// ---- index handling ----
__device__ __forceinline__ int64_t load_index(const void* p, bool i64, int64_t i) {
  return i64 ? cuda::load(static_cast<const long long*>(p) + i) : int64_t(cuda::load(static_cast<const int*>(p) + i));
}

// ---- one side (K or V) of one chunk ----
// prepare() does everything that does not depend on the slot (vector offsets in the source and
// destination rows, the fp8 scale and its reciprocal); load() and store() then only add offsets to
// two row pointers. kPin (latency kernels) keeps prepare()'s work before the kernel's padding check,
// where it runs while the slot load is in flight: otherwise the compiler sinks it to its first use,
// after the slot, and a lone warp at a few cycles per instruction puts ~400 instructions on the
// latency of an n = 1 write. Bulk kernels leave it sunk (fewer live registers, more warps per SM).
// kHeadBytes: destination bytes per head when compiled in, 0 when taken from Side::head_vecs.
// kPerHead: vector u divides by the scale of its own head (else one scale for the side).
template <int kHeadBytes, int kVec, class Cv, bool kPin, bool kPerHead>
struct SideChunk {
  static constexpr int kSrcVec = kVec * Cv::kRatio;
  static constexpr int kUnroll = Cv::kUnroll;
  static constexpr int kScales = kPerHead ? kUnroll : 1;
  static_assert(kHeadBytes % kVec == 0, "head bytes must be a multiple of the vector width");
  static_assert(!kPerHead || Cv::kQuant, "per-head scales are fp8's");

  Pack<kSrcVec> data[kUnroll];
  uint64_t src_addr[kUnroll];  // this lane's source vectors
  int64_t dst_off[kUnroll];    // and their byte offsets in the destination row
  int32_t count;               // vectors u < count lie in the row (after load(): are written)
  int64_t scale_off[kScales];  // per-head scales: element offset of vector u's head's scale
  Divider div[kScales];        // fp8 only

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
      if constexpr (kPerHead) {
        scale_off[u] = int64_t(i / hv) * s.scale_stride;
        if constexpr (kPin) asm volatile("" : "+l"(scale_off[u]));
      }
    }
  }

  // fp8: the scale (a device scale may come from the previous kernel: after the PDL wait). Per head,
  // a vector past the row (u >= count) reads none.
  __device__ __forceinline__ void load_scale(const Side& s) {
    if constexpr (kPerHead) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        div[u] = Divider(s.scale_ptr != nullptr && u < count ? cuda::load(s.scale_ptr + scale_off[u]) : s.scale);
    } else if constexpr (Cv::kQuant) {
      div[0] = Divider(s.scale_ptr ? cuda::load(s.scale_ptr) : s.scale);
    }
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
      if (u < count) store_pack<kVec>(row + dst_off[u], Cv::template run<kVec>(data[u], div[kPerHead ? u : 0]));
  }
};

// slot / block_size for a slot in [0, num_slots), without a branch or a division: exact for every slot
// of a cache the binding accepts (see set_block_division there).
__device__ __forceinline__ uint64_t block_of(int64_t slot, uint32_t magic, int32_t shift) {
  return (uint64_t(__umulhi(uint32_t(slot), magic)) + uint64_t(slot)) >> shift;
}

// The destination geometry of one side. A slot's row is dst + slot * stride_token + block * block_adj
// (block_adj(Side)), so that slot * stride_token is computed while the block number is: a lone warp's
// chain from slot to store stays short.
struct DstRegs {
  char* dst;
  int64_t stride_token, block_adj;
  uint32_t block_magic;
  int32_t block_shift;

  __device__ __forceinline__ static DstRegs of(const Side& s) {
    return DstRegs{s.dst, s.dst_stride_token, store_cache::block_adj(s), s.block_magic, s.block_shift};
  }

  __device__ __forceinline__ uint64_t block(int64_t slot) const { return block_of(slot, block_magic, block_shift); }

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
__device__ __forceinline__ int64_t resolve_slot(const StoreCacheArgs& p, int64_t slot) {
  if (slot < 0 || slot == p.skip_slot) return -1;
  if (p.loc_map == nullptr) return slot;
  if (slot >= p.loc_map_size) return -1;  // never read out of bounds
  return load_index(p.loc_map, p.loc_i64, slot);
}

// Latency kernel: one vector per lane and side. Addresses are computed before the PDL wait (they
// read only the parameter block); after it a warp issues the slot load and its source loads together
// (every token < n has source rows, padding included, so reading them is safe; they are written only
// for a kept slot), lets the next kernel launch, then resolves the slot and stores.
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcType kSrc, Fp8 kFp8, bool kPerHead>
__device__ __forceinline__ void latency_write(const StoreCacheArgs& p) {
  using Cv = Convert<kSrc, kFp8, false>;
  cuda::warm_params(p, p.n);
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const uint32_t first = blockIdx.y * 32 + (threadIdx.x & 31);
  constexpr bool kSplit = split_sides(kFp8, kKHeadBytes, kVHeadBytes, false);
  // With split sides (grid.z = 2) blockIdx.z picks K or V: one code path with the side picked by
  // data (with two, the compiler computes both).
  const Side& first_side = kSplit && blockIdx.z ? p.v : p.k;
  SideChunk<kKHeadBytes, kVec, Cv, true, kPerHead> k;
  SideChunk<kVHeadBytes, kVec, Cv, true, kPerHead> v;
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
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcType kSrc, Fp8 kFp8, bool kPerHead>
__device__ __forceinline__ void bulk_write(const StoreCacheArgs& p) {
  using Cv = Convert<kSrc, kFp8, true>;
  cuda::pdl_wait();  // sources and indices may come from the previous kernel
  cuda::pdl_launch_dependents();
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (token >= p.n) return;
  const int64_t entry = load_index(p.slots, p.slot_i64, token);
  const uint32_t first = blockIdx.y * (32 * Cv::kUnroll) + (threadIdx.x & 31);
  SideChunk<kKHeadBytes, kVec, Cv, false, kPerHead> k;
  SideChunk<kVHeadBytes, kVec, Cv, false, kPerHead> v;
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

// ---- row kernels: the latency kernel for the common decode call, with a compact parameter block ----
// When there is no loc_map, one scale per side (fp8: or contiguous per-head scales), and K and V rows
// are dense in the source and in the cache (heads back to back: flat [S, H*D] / [S, H, D] caches, paged
// NHD ones with one block size for K and V), vector i of a row sits at byte 16 i of the cache row and
// 16 i * ratio of the source row, so a side is two pointers and two strides, kept in 32 and 16 bits
// (16-byte units), and the kernel's parameter block is 64-88 bytes instead of StoreCacheArgs' 264.
// Under graph replay a launch's cost grows with its parameter block (jitkv/cuda/launch.cuh
// warm_params); store_cache_cuda.cu (use_row_kernel) has the measurements and the calls whose values
// fit (fits_row_args). Specialised (16-byte) builds only.
struct RowArgs {
  const char* src[2];  // K, V
  char* dst[2];
  const void* slots;
  int32_t n, num_slots;
  uint32_t dst_stride16[2];  // bytes / 16 from one slot's cache row to the next
  uint16_t src_stride16[2];  // bytes / 16 from one token's source row to the next
  int32_t heads;

  __device__ __forceinline__ const char* src_of(int side) const { return src[side]; }
  __device__ __forceinline__ char* dst_of(int side) const { return dst[side]; }
  __device__ __forceinline__ int64_t src_stride(int side) const { return int64_t{src_stride16[side]} * 16; }
  __device__ __forceinline__ int64_t dst_stride(int side) const { return int64_t{dst_stride16[side]} * 16; }
};
static_assert(sizeof(RowArgs) == 64, "one 64-byte parameter block");

// The fp8 row kernels' block: RowArgs' fields and the two scales in the same 64 bytes. V's source and
// cache are offsets from K's (16-byte units), K and V share their row strides, and a scale is one word:
// a float32 pointer (a device scale; bit 1 set: per-head scales, [heads] contiguous), or the scale's
// bits << 32 | 1 (a Python float). Pointers to float32 are 4-byte aligned, so bits 0 and 1 are free.
// Calls whose values do not fit take the latency kernel (store_cache_cuda.cu fits_row_fp8_args).
// NVIDIA H100, H8 D128 bf16 -> e4m3, flat caches, device scales, graph replay, same run, against RowArgs
// + both scales (88 bytes): n = 1 / 2 / 4 / 8 / 16 0.923 / 0.921 / 0.923 / 0.933 / 0.954 us vs 0.935 /
// 0.929 / 0.938 / 0.949 / 0.970, level at 32-64; per-head scales, against the latency kernel: n = 1 / 2
// / 4 / 8 / 16 / 32 / 64 0.932 / 0.955 / 0.954 / 0.958 / 0.981 / 1.041 / 1.082 us vs 1.172 / 1.180 / 1.161
// / 1.262 / 1.252 / 1.259 / 1.340 (python -m jitkv.benchmark --op store_cache, "bf16->fp8 e4m3" and
// "bf16->fp8 e4m3 per-head" rows).
struct RowFp8Args {
  const char* src;  // K's; V's is src + 16 * v_src16
  char* dst;        // K's; V's is dst + 16 * v_dst16
  const void* slots;
  int32_t v_src16, v_dst16;
  int32_t n, num_slots;
  uint32_t dst_stride16;  // K and V
  uint16_t src_stride16;  // K and V
  uint16_t heads;
  uint64_t scale[2];  // K, V

  __device__ __forceinline__ const char* src_of(int side) const { return src + (side ? int64_t{v_src16} * 16 : 0); }
  __device__ __forceinline__ char* dst_of(int side) const { return dst + (side ? int64_t{v_dst16} * 16 : 0); }
  __device__ __forceinline__ int64_t src_stride(int) const { return int64_t{src_stride16} * 16; }
  __device__ __forceinline__ int64_t dst_stride(int) const { return int64_t{dst_stride16} * 16; }
  // A side's scale: loaded from scale_at(side, head of the lane's vector) when scale_is_ptr(side), else
  // scale_value(side).
  __device__ __forceinline__ bool scale_is_ptr(int side) const { return !(scale[side] & 1); }
  __device__ __forceinline__ const float* scale_at(int side, uint32_t head) const {
    const uint64_t w = scale[side];
    return reinterpret_cast<const float*>((w & ~uint64_t{3}) + (w & 2 ? 4 * uint64_t{head} : 0));
  }
  __device__ __forceinline__ float scale_value(int side) const { return __uint_as_float(uint32_t(scale[side] >> 32)); }
};
static_assert(sizeof(RowFp8Args) == 64, "one 64-byte parameter block");

// Paged caches: a slot's row is dst + slot * dst_stride + (slot / block_size) * block_adj.
struct RowBlocks {
  int64_t k_block_adj, v_block_adj;  // block_adj(Side), per side
  uint32_t block_magic;               // the block division of Side (K and V share the block size)
  int32_t block_shift;
};

struct NoBlocks {};

// The block of one row kernel: RowArgs (copies) or RowFp8Args, then RowBlocks for paged caches.
template <bool kPaged, bool kQuant>
struct RowArgsOf : std::conditional_t<kQuant, RowFp8Args, RowArgs>, std::conditional_t<kPaged, RowBlocks, NoBlocks> {
};

// grid = (ceil(n / warps_per_block), chunks, sides) as the latency kernel; lane l of chunk c moves
// kVec-byte vector 32 c + l of the K row and of the V row (or, with split sides, of the side
// blockIdx.z picks). Every slot outside [0, num_slots) is skipped: the host passes no skip_slot inside it.
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcType kSrc, Fp8 kFp8, bool kPaged, typename TSlot>
__global__ void __launch_bounds__(32 * kMaxWarpsPerBlock)
    store_cache_row_kernel(const __grid_constant__ RowArgsOf<kPaged, kFp8 != Fp8::kNone> p) {
  using Cv = Convert<kSrc, kFp8, false>;
  constexpr int kSrcVec = kVec * Cv::kRatio;
  constexpr bool kSplit = split_sides(kFp8, kKHeadBytes, kVHeadBytes, false);
  cuda::warm_params(p, p.n);
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const uint32_t i = blockIdx.y * 32 + (threadIdx.x & 31);
  const int first = kSplit && blockIdx.z ? 1 : 0;  // the side this warp writes first: V with split sides
  const uint32_t k_head_vecs = (first ? kVHeadBytes : kKHeadBytes) / kVec, v_head_vecs = kVHeadBytes / kVec;
  const bool k_in = i < uint32_t(p.heads) * k_head_vecs;
  const bool v_in = !kSplit && i < uint32_t(p.heads) * v_head_vecs;
  const char* k_src = p.src_of(first) + token * p.src_stride(first) + i * kSrcVec;
  const char* v_src = p.src_of(1) + token * p.src_stride(1) + i * kSrcVec;
  // fp8: where this lane's scales lie (per-head scales: those of vector i's heads), and whether it loads
  // them (a device scale, vector i inside the row): parameter-block arithmetic, kept apart from the
  // loads by an empty asm (the form the RowFp8Args measurements timed; the scale loads issue after
  // the row loads).
  const float *k_scale_at = nullptr, *v_scale_at = nullptr;
  uint32_t k_scale_load = 0, v_scale_load = 0;
  if constexpr (Cv::kQuant) {
    k_scale_at = p.scale_at(first, i / k_head_vecs);
    v_scale_at = p.scale_at(1, i / v_head_vecs);
    k_scale_load = k_in && p.scale_is_ptr(first);
    v_scale_load = v_in && p.scale_is_ptr(1);
    asm volatile("" : "+l"(k_scale_at), "+l"(v_scale_at), "+r"(k_scale_load), "+r"(v_scale_load));
  }
  if (token >= p.n) return;
  cuda::pdl_wait();  // sources, indices and device scales may come from the previous kernel
  const int64_t slot = cuda::load(static_cast<const TSlot*>(p.slots) + token);
  Pack<kSrcVec> kd, vd;
  if (k_in) kd = load_pack<kSrcVec>(k_src);
  if (v_in) vd = load_pack<kSrcVec>(v_src);
  cuda::pdl_launch_dependents();  // after the loads (see set_mla_kv_buffer.cuh)
  // fp8: the scales after the row loads. Loaded first (and the reciprocal pinned before the slot
  // check) the e4m3 write measured 0.05-0.09 us slower at n <= 64 (NVIDIA H100, graph replay).
  cuda::Divider k_div, v_div;
  if constexpr (Cv::kQuant) {
    k_div = cuda::Divider(k_scale_load ? cuda::load(k_scale_at) : p.scale_value(first));
    if constexpr (!kSplit) v_div = cuda::Divider(v_scale_load ? cuda::load(v_scale_at) : p.scale_value(1));
  }
  // Padding (< 0) and out-of-range slots are never written.
  if (uint64_t(slot) >= uint64_t(p.num_slots)) return;
  int64_t k_row = slot * p.dst_stride(first), v_row = slot * p.dst_stride(1);
  if constexpr (kPaged) {
    const int64_t blk = int64_t(block_of(slot, p.block_magic, p.block_shift));
    k_row += blk * (first ? p.v_block_adj : p.k_block_adj);
    v_row += blk * p.v_block_adj;
  }
  if (k_in) store_pack<kVec>(p.dst_of(first) + k_row + i * kVec, Cv::template run<kVec>(kd, k_div));
  if (v_in) store_pack<kVec>(p.dst_of(1) + v_row + i * kVec, Cv::template run<kVec>(vd, v_div));
}

// grid = (ceil(n / warps_per_block), chunks, sides), block = 32 * warps_per_block; one warp per
// (token, chunk), writing K and V. With split_sides (sides = 2), one warp per (token, chunk, side),
// which halves each warp's fp8 conversion chain; bf16 copies stay on one warp (measured slower split).
template <int kKHeadBytes, int kVHeadBytes, int kVec, SrcType kSrc, Fp8 kFp8, bool kBulk, bool kPerHead>
__global__ void __launch_bounds__(32 * kMaxWarpsPerBlock)
    store_cache_kernel(const __grid_constant__ StoreCacheArgs p) {
  if constexpr (kBulk) {
    bulk_write<kKHeadBytes, kVHeadBytes, kVec, kSrc, kFp8, kPerHead>(p);
  } else {
    latency_write<kKHeadBytes, kVHeadBytes, kVec, kSrc, kFp8, kPerHead>(p);
  }
}

#endif  // __CUDACC__

}  // namespace jitkv::store_cache
