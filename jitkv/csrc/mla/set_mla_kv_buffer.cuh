// set_mla_kv_buffer: kv_buffer[loc[i], :nope] = k_nope[i], kv_buffer[loc[i], nope:] = k_rope[i], copied or
// quantized to FP8 on the way (kv_cache_dtype, KvFormat).
//
// The family's parameter block (MlaParams; the kernels get its MlaArgs or MlaFp8Args part) and its
// argument parsers (copy, fp8), shared by the CUDA binding (set_mla_kv_buffer_cuda.cu) and the CPU
// binding (set_mla_kv_buffer_cpu.cpp, which sees only this host part), then the CUDA kernels (compiled
// by nvcc only). A row whose slot is < 0, == skip_slot or >= num_slots is never written.
//
// The copy ("auto") moves bytes:
//  - latency kernel (the default; 16-byte aligned rows that fit in registers): one warp per row (per
//    16-byte register of the row at small n), the slot and the row loaded together
//    (set_mla_kv_buffer_latency_kernel).
//  - bulk kernels: each warp takes kRows consecutive rows per step (grid-stride loop): it reads their
//    slots first and drops a row before loading anything of it; then it loads all kept rows with
//    V-byte vectors (every load issued before any store) and writes them out:
//    - TMA path (SM90+): the lanes put the rows in the warp's shared-memory slots, fence the generic
//      proxy against the async proxy, and lane 0 issues ONE cp.async.bulk shared->global store per row
//      (nope + rope bytes). A slot is rewritten only after the previous step's bulk stores have read
//      it (wait_group.read, checked after the next loads are issued, so it costs nothing).
//    - vector path (any arch, any alignment): the registers are stored straight to global memory.
// The fp8 formats (e4m3 / e5m2 with a per-tensor scale, the fp8_ds_mla record) convert bf16/fp16 rows:
//  - fast kernel (16-byte aligned sources): the latency kernel's pattern with one or two warps per row,
//    an exact branch-free division per value, fp8_ds_mla's tile amax by redux.sync
//    (set_mla_kv_buffer_fp8_kernel);
//  - generic kernel (any alignment): one warp per row, 16-bit loads, byte stores.
// Programmatic dependent launch: see jitkv/cuda/launch.cuh.
#pragma once

#include <cmath>
#include <cstdint>

#include "jitkv/check.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstring>
#include <type_traits>

#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#endif

namespace jitkv::mla {

// kv_cache_dtype as the format codes of jitkv/layouts.py (FP8_CODES, DS_MLA_CODE): a bitwise copy,
// quantizing with a per-tensor scale, or the fp8_ds_mla record.
enum class KvFormat : int32_t { kCopy = 0, kE4M3 = 1, kE5M2 = 2, kDsMla = 3 };

// Shapes: kv_buffer [S, W] or [S, 1, W]; k_nope [n', nope] or [n', 1, nope]; k_rope likewise;
// n' >= n = loc.numel(). Only the innermost dim must be contiguous: row strides are arbitrary and kept
// in bytes. The copy: one dtype everywhere (bf16, fp16, fp32, uint8, float8), W >= nope + rope. The fp8
// formats: bf16/fp16 sources into a 1-byte buffer (parse_fp8_params). The binding checks the device
// type (CPU vs CUDA); the parser checks that all tensors share one.
//
// MlaArgs is what the copy kernels read and all of their parameter block, MlaFp8Args what the fp8
// kernels read; MlaParams adds what only the host needs. A kernel warms every 64-byte line of its block
// before the PDL wait (jitkv/cuda/launch.cuh warm_params), so a block holds nothing its kernel does not
// read: the copy's 80 bytes warmed run 0.83 us at n = 1 on an H100, the same code with 16 more bytes in
// its block 0.90.
struct MlaArgs {
  char* dst;
  const char* nope;
  const char* rope;
  const void* loc;
  int64_t n, num_slots, dst_row_stride, nope_row_stride, rope_row_stride, skip_slot;  // strides: bytes
};

struct MlaFp8Args : MlaArgs {
  const float* scale_ptr;  // per-tensor fp8 scale: a 1-element float32 tensor on the device, or nullptr
  float scale;             // the scale when scale_ptr is nullptr
};

// The latency kernels' compact blocks: MlaArgs in 48 bytes (MlaFp8Args in 64), for the calls whose
// values fit (set_mla_kv_buffer_cuda.cu fits_row_args): n and num_slots below 2^31, source row strides
// in 16-byte units below 1 MiB, the destination's in 8-byte units, and a skip_slot that is no slot of
// the buffer (the default -1), which the kernel then need not test. Under CUDA-graph replay a launch
// costs more the larger its parameter block: NVIDIA H100, the MLA copy's latency kernel, same run, n =
// 1 / 8 / 32 / 128: 0.873 / 0.899 / 0.923 / 0.998 us with MlaArgs' 80 bytes, 0.831 / 0.874 / 0.903 /
// 0.947 with these 48 (python -m jitkv.benchmark --op set_mla_kv_buffer has both: "jit latency" and
// "jit latency, 80-byte block"). The fp8 kernel gains less from its 64 (e4m3 n = 1 / 8 / 64: 0.954 /
// 0.998 / 1.045 against 0.947 / 0.984 / 1.027 us): its conversion chain, not the launch, dominates.
struct MlaRowArgs {
  char* dst;
  const char* nope;
  const char* rope;
  const void* loc;
  int32_t n, num_slots;
  uint16_t nope_stride16, rope_stride16;  // source row strides / 16
  uint32_t dst_stride8;                   // destination row stride / 8
};

struct MlaFp8RowArgs : MlaRowArgs {
  const float* scale_ptr;
  float scale;
};

struct MlaParams : MlaFp8Args {
  int32_t kv_format;               // KvFormat
  int64_t nope_bytes, rope_bytes;  // source bytes per row
  DLDevice device;
  DLDataType dtype;  // of k_nope and k_rope
  bool loc_i64;
};

// A 2-D [rows, width] or 3-D [rows, 1, width] tensor: returns width.
inline int64_t row_width(const char* op, const char* name, const TensorView& t, const char* want) {
  if (t.ndim() == 2 || (t.ndim() == 3 && t.size(1) == 1)) return t.size(t.ndim() - 1);
  TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected shape " << want << ", got " << shape_str(t);
  return 0;
}

struct RowWidths {
  int64_t buffer, nope, rope;  // elements
};

// The checks every format shares (devices, shapes, contiguity, the index) and the fields that do not
// depend on the format; the callers check dtypes before and their row-width rule after.
inline MlaParams parse_rows(const char* op, const TensorView& kv_buffer, const TensorView& loc,
                            const TensorView& k_nope, const TensorView& k_rope, int64_t skip_slot, RowWidths& w) {
  const DLDevice dev = kv_buffer.device();
  check_device(op, "cache_k_nope", k_nope, dev, "kv_buffer");
  check_device(op, "cache_k_rope", k_rope, dev, "kv_buffer");
  check_device(op, "loc", loc, dev, "kv_buffer");
  w.buffer = row_width(op, "kv_buffer", kv_buffer, "[num_slots, W] or [num_slots, 1, W]");
  w.nope = row_width(op, "cache_k_nope", k_nope, "[n, nope] or [n, 1, nope]");
  w.rope = row_width(op, "cache_k_rope", k_rope, "[n, rope] or [n, 1, rope]");
  check_last_dim_contiguous(op, "kv_buffer", kv_buffer);
  check_last_dim_contiguous(op, "cache_k_nope", k_nope);
  check_last_dim_contiguous(op, "cache_k_rope", k_rope);
  const bool loc_i64 = check_index(op, "loc", loc);
  const int64_t n = loc.numel();
  check_rows_at_least(op, "cache_k_nope", k_nope, n, "loc");
  check_rows_at_least(op, "cache_k_rope", k_rope, n, "loc");

  const int64_t es = elem_bytes(k_nope.dtype());
  MlaParams p;
  p.dst = data_ptr(kv_buffer);
  p.nope = data_ptr(k_nope);
  p.rope = data_ptr(k_rope);
  p.loc = data_ptr(loc);
  p.n = n;
  p.num_slots = kv_buffer.size(0);
  p.dst_row_stride = kv_buffer.stride(0) * elem_bytes(kv_buffer.dtype());
  p.nope_row_stride = k_nope.stride(0) * es;
  p.rope_row_stride = k_rope.stride(0) * es;
  p.skip_slot = skip_slot;
  p.scale_ptr = nullptr;
  p.scale = 1.0f;
  p.kv_format = static_cast<int32_t>(KvFormat::kCopy);
  p.nope_bytes = w.nope * es;
  p.rope_bytes = w.rope * es;
  p.device = dev;
  p.dtype = k_nope.dtype();
  p.loc_i64 = loc_i64;
  return p;
}

inline MlaParams parse_params(const char* op, const TensorView& kv_buffer, const TensorView& loc,
                              const TensorView& k_nope, const TensorView& k_rope, int64_t skip_slot) {
  const DLDataType dt = kv_buffer.dtype();
  if (!is_copy_dtype(dt)) {
    TVM_FFI_THROW(TypeError) << op << ": kv_buffer: expected dtype bfloat16, float16, float32, uint8, "
                             << "float8_e4m3fn or float8_e5m2, got " << dt;
  }
  check_same_dtype(op, "cache_k_nope", k_nope, dt, "kv_buffer");
  check_same_dtype(op, "cache_k_rope", k_rope, dt, "kv_buffer");
  RowWidths w;
  const MlaParams p = parse_rows(op, kv_buffer, loc, k_nope, k_rope, skip_slot, w);
  if (w.buffer < w.nope + w.rope) {
    TVM_FFI_THROW(ValueError) << op << ": kv_buffer: row width " << w.buffer << " is smaller than nope + rope = "
                              << w.nope << " + " << w.rope;
  }
  return p;
}

// ---- FP8 formats: compiled into the modules built with the fp8_ds_mla record's layout (the CPU module
// and the CUDA modules of an fp8 format) ----
#if defined(JITKV_DSMLA_BYTES)

// The fp8_ds_mla record (build arguments from jitkv/layouts.py DS_MLA_*): kNope values as e4m3 bytes in
// tiles of kTile, a float32 scale per tile at kScaleOffset, the kRope 16-bit rope values at kRopeOffset.
struct DsMla {
  static constexpr int kNope = JITKV_DSMLA_NOPE;
  static constexpr int kRope = JITKV_DSMLA_ROPE;
  static constexpr int kTile = JITKV_DSMLA_TILE;
  static constexpr int kTiles = kNope / kTile;
  static constexpr int kScaleOffset = JITKV_DSMLA_SCALES;
  static constexpr int kRopeOffset = JITKV_DSMLA_ROPE_AT;
  static constexpr int kBytes = JITKV_DSMLA_BYTES;
  static constexpr float kFp8Max = 448.0f;  // e4m3: the tile scale is amax / kFp8Max
  static_assert(kNope % kTile == 0 && kScaleOffset >= kNope && kRopeOffset >= kScaleOffset + 4 * kTiles &&
                    kBytes >= kRopeOffset + 2 * kRope,
                "fp8_ds_mla record parts overlap");
};

inline const char* format_name(KvFormat f) {
  return f == KvFormat::kE4M3 ? "fp8_e4m3" : f == KvFormat::kE5M2 ? "fp8_e5m2" : "fp8_ds_mla";
}

// The Python wrapper passes kv_cache_dtype as its code (a String argument costs tvm-ffi build time).
inline KvFormat parse_fp8_format(const char* op, int64_t code) {
  if (code < static_cast<int64_t>(KvFormat::kE4M3) || code > static_cast<int64_t>(KvFormat::kDsMla)) {
    TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: expected code 1 (\"fp8_e4m3\"), 2 (\"fp8_e5m2\") or 3 "
                              << "(\"fp8_ds_mla\"), got " << code;
  }
  return static_cast<KvFormat>(code);
}

inline bool is_fp8_source(DLDataType d) {
  return d.lanes == 1 && d.bits == 16 && (d.code == kDLBfloat || d.code == kDLFloat);
}

// uint8, or the float8 dtype of a per-tensor format.
inline void check_fp8_buffer(const char* op, const TensorView& kv_buffer, KvFormat f) {
  const DLDataType d = kv_buffer.dtype();
  if (d.lanes == 1 && d.bits == 8 &&
      (d.code == kDLUInt || (f == KvFormat::kE4M3 && d.code == kDLFloat8_e4m3fn) ||
       (f == KvFormat::kE5M2 && d.code == kDLFloat8_e5m2))) {
    return;
  }
  const char* fp8 = f == KvFormat::kE4M3 ? " or float8_e4m3fn" : f == KvFormat::kE5M2 ? " or float8_e5m2" : "";
  TVM_FFI_THROW(ValueError) << op << ": kv_buffer: kv_cache_dtype=\"" << format_name(f) << "\" writes a uint8" << fp8
                            << " buffer, got " << d;
}

// The per-tensor formats' scale: a 1-element float32 tensor on the buffer's device (read by the kernel,
// so a CUDA graph replays with its new value), or a Python float (value; -1.0 exactly means "not
// given"), finite and > 0 as float32. fp8_ds_mla takes none: it computes one scale per tile.
inline void parse_fp8_scale(const char* op, KvFormat f, const Optional<TensorView>& scale, double value,
                            MlaParams& p) {
  if (f == KvFormat::kDsMla) {
    if (scale.has_value() || value != -1.0) {
      TVM_FFI_THROW(ValueError) << op << ": scale: kv_cache_dtype=\"fp8_ds_mla\" computes one scale per "
                                << DsMla::kTile << "-value tile; expected None";
    }
    return;
  }
  if (scale.has_value()) {
    const TensorView& s = scale.value();
    check_device(op, "scale", s, p.device, "kv_buffer");
    if (!(s.dtype().code == kDLFloat && s.dtype().bits == 32 && s.dtype().lanes == 1)) {
      TVM_FFI_THROW(TypeError) << op << ": scale: expected a float32 tensor, got " << s.dtype();
    }
    if (s.numel() != 1) {
      TVM_FFI_THROW(ValueError) << op << ": scale: expected a 1-element tensor, got shape " << shape_str(s);
    }
    p.scale_ptr = reinterpret_cast<const float*>(data_ptr(s));
    return;
  }
  if (value == -1.0) {
    TVM_FFI_THROW(ValueError) << op << ": scale: kv_cache_dtype=\"" << format_name(f) << "\" requires a scale "
                              << "(a float or a 1-element float32 tensor, finite and > 0), got None";
  }
  const float v = static_cast<float>(value);
  if (!(std::isfinite(v) && v > 0.0f)) {
    TVM_FFI_THROW(ValueError) << op << ": scale: must be finite and > 0 (as float32), got " << value;
  }
  p.scale = v;
}

// The fp8 formats: k_nope and k_rope bf16 or fp16 (one dtype); kv_buffer uint8 (or the format's float8
// dtype); e4m3/e5m2: W >= nope + rope and a scale; fp8_ds_mla: nope and rope of the record, W >= its
// bytes, no scale.
inline MlaParams parse_fp8_params(const char* op, const TensorView& kv_buffer, const TensorView& loc,
                                  const TensorView& k_nope, const TensorView& k_rope, int64_t skip_slot,
                                  int64_t kv_format, const Optional<TensorView>& scale, double scale_value) {
  const KvFormat f = parse_fp8_format(op, kv_format);
  if (!is_fp8_source(k_nope.dtype())) {
    TVM_FFI_THROW(TypeError) << op << ": cache_k_nope: fp8 quantize-on-write takes bfloat16 or float16 sources, got "
                             << k_nope.dtype();
  }
  check_same_dtype(op, "cache_k_rope", k_rope, k_nope.dtype(), "cache_k_nope");
  check_fp8_buffer(op, kv_buffer, f);
  RowWidths w;
  MlaParams p = parse_rows(op, kv_buffer, loc, k_nope, k_rope, skip_slot, w);
  if (f == KvFormat::kDsMla) {
    if (w.nope != DsMla::kNope) {
      TVM_FFI_THROW(ValueError) << op << ": cache_k_nope: fp8_ds_mla takes rows of " << DsMla::kNope << " values, got "
                                << w.nope;
    }
    if (w.rope != DsMla::kRope) {
      TVM_FFI_THROW(ValueError) << op << ": cache_k_rope: fp8_ds_mla takes rows of " << DsMla::kRope << " values, got "
                                << w.rope;
    }
    if (w.buffer < DsMla::kBytes) {
      TVM_FFI_THROW(ValueError) << op << ": kv_buffer: row width " << w.buffer << " is smaller than the "
                                << DsMla::kBytes << "-byte fp8_ds_mla record";
    }
  } else if (w.buffer < w.nope + w.rope) {
    TVM_FFI_THROW(ValueError) << op << ": kv_buffer: row width " << w.buffer << " is smaller than nope + rope = "
                              << w.nope << " + " << w.rope;
  }
  parse_fp8_scale(op, f, scale, scale_value, p);
  p.kv_format = static_cast<int32_t>(f);
  return p;
}

#endif  // JITKV_DSMLA_BYTES

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
__global__ void __launch_bounds__(32 * 8)
    set_mla_kv_buffer_latency_kernel(const __grid_constant__ Args p) {
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
  cuda::pdl_launch_dependents();  // after the loads: triggering before them measured 0.15 us slower
  if (keeps(p, slot)) {
    char* dst = p.dst + slot * dst_stride(p);
#pragma unroll
    for (int i = 0; i < S::kIters; ++i) {
      if (i % kRowWarps == part) store_vec<kNope, kRope, 16>(r[i], i, dst, lane);
    }
  }
}

template <int kNope, int kRope, int V, int kWarps, int kRows, bool kTma, typename TLoc>
__global__ void __launch_bounds__(kWarps * 32)
    set_mla_kv_buffer_kernel(const __grid_constant__ MlaArgs p) {
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

#if defined(JITKV_DSMLA_BYTES)
// ---- FP8 writers ----
// stored = cvt.rn.satfinite(x / scale) with the correctly rounded fp32 quotient (cuda::Divider::quick,
// no branch; the generic kernel: __fdiv_rn), then the hardware's round-to-nearest-even conversion,
// which saturates finite overflow and +-inf to +-max (the bytes of clamp(-max, max) first) and gives
// 0x7F for NaN: bit-equal to torch's (x.float() / scale).clamp(-max, max).to(float8) on the GPU.

enum class Src16 : int { kBF16 = 1, kF16 = 2 };  // k_nope/k_rope dtype of an fp8 module (JitSpec src_dtype)

template <Src16 kSrc>
struct Src16Traits {
  static constexpr uint32_t kInf = kSrc == Src16::kBF16 ? 0x7f80u : 0x7c00u;  // magnitude of inf
  static constexpr uint32_t kNanAbove = kInf;                                   // magnitudes above: NaN

  __device__ __forceinline__ static float value(uint32_t bits) {  // one value in the low 16 bits
    if constexpr (kSrc == Src16::kBF16) {
      return __uint_as_float(bits << 16);
    } else {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    }
  }
  __device__ __forceinline__ static float2 pair(uint32_t w) {  // a word's two values, the low half first
    if constexpr (kSrc == Src16::kBF16) {
      return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    } else {
      __half2 h;
      memcpy(&h, &w, sizeof(h));
      return __half22float2(h);
    }
  }
};

// Largest magnitude of a vector's values leaving NaN out (fmaxf's rule), one by one.
template <Src16 kSrc>
__device__ __forceinline__ uint32_t max_mag_no_nan(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t best = 0;
  for (int k = 0; k < 8; ++k) {
    const uint32_t m = (w[k / 2] >> (16 * (k % 2))) & 0x7fffu;
    if (m <= Src16Traits<kSrc>::kNanAbove && m > best) best = m;
  }
  return best;
}

// Largest magnitude (a 16-bit pattern without its sign) of a 16-byte vector's 8 values, NaN left out
// (fmaxf's rule): packed 16-bit max; a vector whose largest half is a NaN pattern (the carry of
// adding 0x7fff - inf reaches the half's top bit) takes max_mag_no_nan.
template <Src16 kSrc>
__device__ __forceinline__ uint32_t vec_amax_no_nan(const uint4& v) {
  constexpr uint32_t kNanCarry = (0x7fffu - Src16Traits<kSrc>::kInf) * 0x10001u;
  const uint32_t a = v.x & 0x7fff7fffu, b = v.y & 0x7fff7fffu, c = v.z & 0x7fff7fffu, d = v.w & 0x7fff7fffu;
  const uint32_t mx = __vmaxu2(__vmaxu2(a, b), __vmaxu2(c, d));
  if ((mx + kNanCarry) & 0x80008000u) return max_mag_no_nan<kSrc>(v);
  return max(mx >> 16, mx & 0xffffu);
}

template <KvFormat kFmt>
constexpr __nv_fp8_interpretation_t fp8_interp() {
  return kFmt == KvFormat::kE5M2 ? __NV_E5M2 : __NV_E4M3;  // fp8_ds_mla stores e4m3
}

template <KvFormat kFmt>
__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, fp8_interp<kFmt>());
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, fp8_interp<kFmt>());
  return lo | (hi << 16);
}

// The 8 fp8 bytes of a 16-byte source vector: x / scale through Divider::quick.
template <Src16 kSrc, KvFormat kFmt>
__device__ __forceinline__ uint2 quantize_vec(const uint4& v, const cuda::Divider& d) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float q[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 x = Src16Traits<kSrc>::pair(w[k]);
    q[2 * k] = d.quick(x.x);
    q[2 * k + 1] = d.quick(x.y);
  }
  return make_uint2(fp8x4<kFmt>(q[0], q[1], q[2], q[3]), fp8x4<kFmt>(q[4], q[5], q[6], q[7]));
}

// A row as the fast fp8 kernel sees it: 16-byte source vectors of 8 values, kNopeBytes / 16 of k_nope
// then kRopeBytes / 16 of k_rope, taken by kRowWarps warps: warp w takes the w-th share of each part, its
// lane l the vectors l, l + 32, ... of that share.
template <int kNopeBytes, int kRopeBytes, int kRowWarps>
struct Fp8Row {
  static_assert(kNopeBytes % 16 == 0 && kRopeBytes % 16 == 0, "rows of 16-byte source vectors");
  static constexpr int kNopeShare = kNopeBytes / 16 / kRowWarps;
  static constexpr int kRopeShare = kRopeBytes / 16 / kRowWarps;
  static_assert(kNopeShare * kRowWarps * 16 == kNopeBytes && kRopeShare * kRowWarps * 16 == kRopeBytes,
                "each part splits evenly across the row's warps");
  static constexpr int kNopeIters = (kNopeShare + 31) / 32;
  static constexpr int kRopeIters = (kRopeShare + 31) / 32;

  // Whether a lane's register i holds a vector (compile-time true but for a last, partial one).
  __device__ __forceinline__ static bool nope_has(int i, int lane) {
    return 32 * i + 31 < kNopeShare || 32 * i + lane < kNopeShare;
  }
  __device__ __forceinline__ static bool rope_has(int i, int lane) {
    return 32 * i + 31 < kRopeShare || 32 * i + lane < kRopeShare;
  }
};

// A lane's fp8 bytes of its nope and rope vectors (8 per vector).
template <int kNope, int kRope>
struct Fp8Words {
  uint2 nope[kNope];
  uint2 rope[kRope > 0 ? kRope : 1];
};

// Rows can split across two warps when both parts halve into 16-byte vectors.
template <int kNopeBytes, int kRopeBytes>
constexpr bool fp8_row_splits() {
  return kNopeBytes % 32 == 0 && kRopeBytes % 32 == 0;
}

// Lane 0's store of its warp's tile scales (consecutive floats).
template <int kCount>
__device__ __forceinline__ void store_scales(char* dst, const float (&s)[kCount]) {
  if constexpr (kCount == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(s[0], s[1], s[2], s[3]);
  } else if constexpr (kCount == 2) {
    *reinterpret_cast<float2*>(dst) = make_float2(s[0], s[1]);
  } else {
#pragma unroll
    for (int t = 0; t < kCount; ++t) reinterpret_cast<float*>(dst)[t] = s[t];
  }
}

// fp8_ds_mla tile scale from its amax (a 16-bit magnitude, not NaN): max(amax / 448, FLT_MIN) with the
// correctly rounded quotient, without __fdiv_rn's range check and branch (which would keep the tiles'
// reductions from overlapping): q = amax * RN(1 / 448) and one residual correction give it for every
// finite bf16 and fp16 amax (the CUDA tests feed every one of them); +inf stays +inf.
template <Src16 kSrc>
__device__ __forceinline__ float ds_mla_scale(uint32_t amax) {
  constexpr float kInv = 1.0f / DsMla::kFp8Max;
  const float a = Src16Traits<kSrc>::value(amax);
  const float q = __fmul_rn(a, kInv);
  const float exact = __fmaf_rn(__fmaf_rn(-q, DsMla::kFp8Max, a), kInv, q);
  return fmaxf(amax == Src16Traits<kSrc>::kInf ? a : exact, FLT_MIN);
}

// Fast fp8 kernel (16-byte aligned sources; destination rows 8-byte aligned, 16 for fp8_ds_mla): the
// latency pattern of set_mla_kv_buffer_latency_kernel with kRowWarps warps per row. Addresses before
// the PDL wait; after it each warp issues its slot load, the per-tensor scale and all of its source
// loads at once (padding rows' sources are read, never written), lets the next kernel launch, quantizes,
// and stores if the slot is kept. No branch: the conversions of a lane's vectors form one block of
// straight-line code the scheduler interleaves (cuda::Divider::quick). fp8_ds_mla: a tile's amax is a
// redux.sync max over the warp of the lanes' largest magnitudes (NaN left out, as vLLM's fmaxf does),
// its scale max(amax / 448, FLT_MIN); lane 0 stores the warp's tile scales and the rope vectors are
// copied unchanged. Args: MlaFp8RowArgs, or MlaFp8Args for the calls it cannot hold.
template <KvFormat kFmt, Src16 kSrc, int kNopeBytes, int kRopeBytes, int kRowWarps, typename TLoc, typename Args>
__global__ void __launch_bounds__(32 * 8)
    set_mla_kv_buffer_fp8_kernel(const __grid_constant__ Args p) {
  using R = Fp8Row<kNopeBytes, kRopeBytes, kRowWarps>;
  constexpr bool kDs = kFmt == KvFormat::kDsMla;
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t row = warp / kRowWarps;
  const int share = static_cast<int>(warp % kRowWarps);
  cuda::warm_params(p, p.n);
  if (row >= p.n) return;
  const int nope_vec = share * R::kNopeShare + lane;  // index of this lane's first vector in its part
  const int rope_vec = share * R::kRopeShare + lane;
  const char* nope = p.nope + row * nope_stride(p) + nope_vec * 16;
  const char* rope = p.rope + row * rope_stride(p) + rope_vec * 16;
  cuda::pdl_wait();  // loc, the sources and a device scale may come from the previous kernel
  const int64_t slot = static_cast<int64_t>(cuda::load(static_cast<const TLoc*>(p.loc) + row));
  float scale = 0.0f;
  if constexpr (!kDs) scale = p.scale_ptr ? cuda::load(p.scale_ptr) : p.scale;
  uint4 vn[R::kNopeIters] = {};
  uint4 vr[R::kRopeIters > 0 ? R::kRopeIters : 1] = {};
#pragma unroll
  for (int i = 0; i < R::kNopeIters; ++i) {
    if (R::nope_has(i, lane)) vn[i] = cuda::load(reinterpret_cast<const uint4*>(nope) + 32 * i);
  }
#pragma unroll
  for (int i = 0; i < R::kRopeIters; ++i) {
    if (R::rope_has(i, lane)) vr[i] = cuda::load(reinterpret_cast<const uint4*>(rope) + 32 * i);
  }
  cuda::pdl_launch_dependents();

  using Words = Fp8Words<R::kNopeIters, kDs ? 0 : R::kRopeIters>;  // fp8_ds_mla copies its rope vectors
  Words q;
  constexpr int kVecsPerTile = kDs ? DsMla::kTile / 8 : 1;
  constexpr int kTilesPerReg = 32 / kVecsPerTile;  // a register row of the warp spans this many tiles
  constexpr int kWarpTiles = kDs ? R::kNopeShare / kVecsPerTile : 1;
  float tile_scale[kWarpTiles];
  if constexpr (kDs) {
    static_assert(kNopeBytes == 2 * DsMla::kNope && kRopeBytes == 2 * DsMla::kRope, "the fp8_ds_mla record's parts");
    static_assert(32 % kVecsPerTile == 0 && R::kNopeShare % 32 == 0, "whole tiles per register row");
    static_assert(DsMla::kScaleOffset % 16 == 0 && DsMla::kRopeOffset % 16 == 0, "16-byte aligned record parts");
    const int tile_in_reg = lane / kVecsPerTile;
    uint32_t part[kWarpTiles];
#pragma unroll
    for (int i = 0; i < R::kNopeIters; ++i) {
      const uint32_t a = vec_amax_no_nan<kSrc>(vn[i]);
#pragma unroll
      for (int h = 0; h < kTilesPerReg; ++h) part[i * kTilesPerReg + h] = tile_in_reg == h ? a : 0u;
    }
#pragma unroll
    for (int t = 0; t < kWarpTiles; ++t) tile_scale[t] = ds_mla_scale<kSrc>(__reduce_max_sync(0xffffffffu, part[t]));
#pragma unroll
    for (int i = 0; i < R::kNopeIters; ++i) {
      float s = tile_scale[i * kTilesPerReg];
#pragma unroll
      for (int h = 1; h < kTilesPerReg; ++h) s = tile_in_reg == h ? tile_scale[i * kTilesPerReg + h] : s;
      q.nope[i] = quantize_vec<kSrc, kFmt>(vn[i], cuda::Divider(s));
    }
  } else {
    const cuda::Divider d(scale);
#pragma unroll
    for (int i = 0; i < R::kNopeIters; ++i) q.nope[i] = quantize_vec<kSrc, kFmt>(vn[i], d);
#pragma unroll
    for (int i = 0; i < R::kRopeIters; ++i) q.rope[i] = quantize_vec<kSrc, kFmt>(vr[i], d);
  }

  if (keeps(p, slot)) {
    char* dst = p.dst + slot * dst_stride(p);
#pragma unroll
    for (int i = 0; i < R::kNopeIters; ++i) {
      if (R::nope_has(i, lane)) reinterpret_cast<uint2*>(dst)[nope_vec + 32 * i] = q.nope[i];
    }
    if constexpr (kDs) {
      if (lane == 0) store_scales(dst + DsMla::kScaleOffset + 4 * kWarpTiles * share, tile_scale);
#pragma unroll
      for (int i = 0; i < R::kRopeIters; ++i) {
        if (R::rope_has(i, lane)) reinterpret_cast<uint4*>(dst + DsMla::kRopeOffset)[rope_vec + 32 * i] = vr[i];
      }
    } else {
#pragma unroll
      for (int i = 0; i < R::kRopeIters; ++i) {
        if (R::rope_has(i, lane)) reinterpret_cast<uint2*>(dst + kNopeBytes / 2)[rope_vec + 32 * i] = q.rope[i];
      }
    }
  }
}

// Lanes fp8 kernel (e4m3 / e5m2; the fast kernel's alignment): the copy latency kernel's layout with one
// 16-byte source vector per lane. Vector j of a row (k_nope's vectors, then k_rope's: RowShape) goes to
// lane j % 32 of the row's warp j / 32 (3 warps for 512+64 bf16), and its 8 fp8 bytes to byte 8 j of the
// destination row, where the quantized nope and rope lie back to back. A warp converts one vector per
// lane, half of split's chain. After the PDL wait every load goes out (slot, scale, source vector), the
// next kernel may launch, and the slot test comes right after that trigger: it ends the trigger's
// basic block. Without it ptxas schedules the scale's reciprocal ahead of the trigger, which then
// waits for the scale load: NVIDIA H100, 512+64 bf16 -> e4m3, graph replay, same run, n = 2 / 4 / 8 /
// 16 / 32 0.956 / 1.010 / 1.018 / 1.024 / 1.040 us that way, 0.927 / 0.904 / 0.919 / 0.928 / 0.954
// this way (the benchmark's "jit lanes" row re-measures the latter). Args: MlaFp8RowArgs, or
// MlaFp8Args for the calls it cannot hold.
template <KvFormat kFmt, Src16 kSrc, int kNopeBytes, int kRopeBytes, typename TLoc, typename Args>
__global__ void __launch_bounds__(32 * 8)
    set_mla_kv_buffer_fp8_lanes_kernel(const __grid_constant__ Args p) {
  using S = RowShape<kNopeBytes, kRopeBytes, 16>;
  static_assert(kFmt != KvFormat::kDsMla, "fp8_ds_mla records are not [nope | rope] fp8 bytes");
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t row = warp / S::kIters;
  const int j = static_cast<int>(warp % S::kIters) * 32 + (threadIdx.x & 31);
  cuda::warm_params(p, p.n);
  if (row >= p.n || j >= S::kVecs) return;
  const char* src = j < S::kNopeVecs ? p.nope + row * nope_stride(p) + 16 * j
                                     : p.rope + row * rope_stride(p) + 16 * (j - S::kNopeVecs);
  cuda::pdl_wait();  // loc, the sources and a device scale may come from the previous kernel
  const int64_t slot = static_cast<int64_t>(cuda::load(static_cast<const TLoc*>(p.loc) + row));
  const float scale = p.scale_ptr ? cuda::load(p.scale_ptr) : p.scale;
  const uint4 v = cuda::load(reinterpret_cast<const uint4*>(src));
  cuda::pdl_launch_dependents();  // after every load (see set_mla_kv_buffer_latency_kernel)
  if (!keeps(p, slot)) return;     // padding, skipped and out-of-range slots are never written
  reinterpret_cast<uint2*>(p.dst + slot * dst_stride(p))[j] = quantize_vec<kSrc, kFmt>(v, cuda::Divider(scale));
}

template <KvFormat kFmt>
__device__ __forceinline__ char fp8_byte(float q) {
  return static_cast<char>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, fp8_interp<kFmt>()));
}

// Generic fp8 kernel (any alignment, any row length): one warp per row; the slot first, then 16-bit
// loads, __fdiv_rn per value and byte stores. fp8_ds_mla tile by tile: fmaxf over the lane's values
// (NaN left out), then a redux.sync max of the lanes' amax bits (non-negative floats order as their bits).
template <KvFormat kFmt, Src16 kSrc, int kNopeBytes, int kRopeBytes, typename TLoc>
__global__ void __launch_bounds__(32 * 8)
    set_mla_kv_buffer_fp8_generic_kernel(const __grid_constant__ MlaFp8Args p) {
  using T = Src16Traits<kSrc>;
  cuda::warm_params(p, p.n);
  cuda::pdl_wait();
  cuda::pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= p.n) return;
  const int64_t slot = static_cast<int64_t>(cuda::load(static_cast<const TLoc*>(p.loc) + row));
  if (!keeps(p, slot)) return;
  char* dst = p.dst + slot * p.dst_row_stride;
  const auto* nope = reinterpret_cast<const unsigned short*>(p.nope + row * p.nope_row_stride);
  const auto* rope = reinterpret_cast<const unsigned short*>(p.rope + row * p.rope_row_stride);
  if constexpr (kFmt == KvFormat::kDsMla) {
    static_assert(kNopeBytes == 2 * DsMla::kNope && kRopeBytes == 2 * DsMla::kRope, "the fp8_ds_mla record's parts");
    for (int t = 0; t < DsMla::kTiles; ++t) {
      const unsigned short* x = nope + t * DsMla::kTile;
      float amax = 0.0f;
      for (int k = lane; k < DsMla::kTile; k += 32) amax = fmaxf(amax, fabsf(T::value(cuda::load(x + k))));
      amax = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(amax)));
      const float s = fmaxf(__fdiv_rn(amax, DsMla::kFp8Max), FLT_MIN);
      if (lane == 0) memcpy(dst + DsMla::kScaleOffset + 4 * t, &s, sizeof(s));
      for (int k = lane; k < DsMla::kTile; k += 32) {
        dst[t * DsMla::kTile + k] = fp8_byte<kFmt>(__fdiv_rn(T::value(cuda::load(x + k)), s));
      }
    }
    const char* rope_bytes = reinterpret_cast<const char*>(rope);
    for (int k = lane; k < 2 * DsMla::kRope; k += 32) dst[DsMla::kRopeOffset + k] = rope_bytes[k];
  } else {
    const float s = p.scale_ptr ? cuda::load(p.scale_ptr) : p.scale;
    for (int k = lane; k < kNopeBytes / 2; k += 32) dst[k] = fp8_byte<kFmt>(__fdiv_rn(T::value(cuda::load(nope + k)), s));
    for (int k = lane; k < kRopeBytes / 2; k += 32) {
      dst[kNopeBytes / 2 + k] = fp8_byte<kFmt>(__fdiv_rn(T::value(cuda::load(rope + k)), s));
    }
  }
}
#endif  // JITKV_DSMLA_BYTES

#endif  // __CUDACC__

}  // namespace jitkv::mla
