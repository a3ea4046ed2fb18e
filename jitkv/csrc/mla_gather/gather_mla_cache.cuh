// gather_mla_cache: the tokens of each request, from a paged MLA cache [num_blocks, block_size, W]
// through its block table, into contiguous rows of out [total_tokens, D], copied or dequantized.
//
// The family's one parameter block (GatherParams), its argument parser (shared by the CUDA binding
// gather_mla_cache_cuda.cu and the CPU binding gather_mla_cache_cpu.cpp), the row -> cache entry
// rule both bindings run (entry_offset), then the CUDA kernel (compiled by nvcc only).
//
// Output row t belongs to request r, the largest r < num_reqs with cu_seq_lens[r] <= t, when
// t < cu_seq_lens[r + 1] (other rows are never written); it is token i = t - cu_seq_lens[r], at
// position p = seq_starts[r] + i (no seq_starts: p = i) of the request's block table: block
// block_table[r, p / block_size], row p % block_size. A position < 0 or past the table's width, or a
// block entry < 0 or >= num_blocks, gives a zero row: nothing outside the cache is read. Rows are
// those of out only: out.shape[0] is the total the kernel covers (graph-safe: the device-side
// cu_seq_lens[num_reqs] is never read on the host), so requests running past it are clipped.
//
// Formats (kv_cache_dtype, codes from jitkv/layouts.py): 0 "auto" copies the entry's bytes (out has
// the cache's dtype, D = W); 1 "fp8_e4m3" / 2 "fp8_e5m2": out = bf16(float(x) * scale), a per-tensor
// scale (D = W); 3 "fp8_ds_mla": the 656-byte record [512 e4m3 in tiles of 128 | 4 fp32 tile scales |
// 64 bf16 rope], out = bf16(float(e4m3) * its tile's scale) for the nope dims and the rope dims
// copied (D = 576). bf16 rounds to nearest even; a NaN is written as 0x7FFF.
#pragma once

#include <cstdint>

#include "jitkv/check.h"

#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#define JITKV_HD __host__ __device__
#else
#define JITKV_HD
#endif

#if !defined(JITKV_DS_NOPE) || !defined(JITKV_DS_ROPE) || !defined(JITKV_DS_TILE) || !defined(JITKV_DS_SCALE_AT) || \
    !defined(JITKV_DS_ROPE_AT) || !defined(JITKV_DS_RECORD)
#error "gather_mla_cache.cuh needs the fp8_ds_mla record layout: -DJITKV_DS_NOPE, _ROPE, _TILE, _SCALE_AT, _ROPE_AT, _RECORD"
#endif

namespace jitkv::mla_gather {

enum Format : int32_t { kCopy = 0, kFp8E4M3 = 1, kFp8E5M2 = 2, kDsMla = 3 };

// The fp8_ds_mla record (jitkv/layouts.py DS_MLA_*, passed as build arguments), in bytes.
struct DsMla {
  static constexpr int kNope = JITKV_DS_NOPE;          // e4m3 values, one byte each
  static constexpr int kRope = JITKV_DS_ROPE;          // bf16 values
  static constexpr int kTile = JITKV_DS_TILE;          // nope values per fp32 scale
  static constexpr int kScaleAt = JITKV_DS_SCALE_AT;   // first tile scale
  static constexpr int kRopeAt = JITKV_DS_ROPE_AT;     // first rope value
  static constexpr int kRecord = JITKV_DS_RECORD;
  static constexpr int kOutDims = kNope + kRope;
};

// Shapes: out [T, D]; kv_cache [num_blocks, block_size, W]; block_table [>= num_reqs, max_blocks];
// cu_seq_lens [num_reqs + 1]; seq_starts [>= num_reqs] or absent. Index tensors int32 or int64. Only
// the innermost dims must be contiguous: the other strides are kept (bytes, block_table: elements).
struct GatherParams {
  char* out;
  const char* cache;
  const void* block_table;
  const void* cu_seq_lens;
  const void* seq_starts;  // nullptr: positions start at 0
  const float* scale_ptr;  // fp8_e4m3/e5m2: a 1-element float32 tensor read on the device, else nullptr
  int64_t rows;            // out.shape[0]
  int64_t num_reqs;
  int64_t out_row_stride;  // bytes
  int64_t num_blocks, block_size, block_stride, token_stride;  // strides in bytes
  int64_t bt_row_stride, max_blocks;                           // block_table, in elements
  int64_t entry_bytes, out_row_bytes;  // a cache entry as stored (W elements), an output row (D elements)
  float scale_value;                   // the scale when scale_ptr is nullptr
  int32_t format;
  bool bt_i64, cu_i64, starts_i64;
  DLDevice device;
};

inline const char* format_name(int64_t f) {
  switch (f) {
    case kCopy: return "auto";
    case kFp8E4M3: return "fp8_e4m3";
    case kFp8E5M2: return "fp8_e5m2";
    default: return "fp8_ds_mla";
  }
}

namespace detail {

inline bool is_u8(DLDataType d) { return d.code == kDLUInt && d.bits == 8 && d.lanes == 1; }
inline bool is_bf16(DLDataType d) { return d.code == kDLBfloat && d.bits == 16 && d.lanes == 1; }

inline Format parse_format(const char* op, int64_t code) {
  if (code >= kCopy && code <= kDsMla) return static_cast<Format>(code);
  TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: expected code 0 (\"auto\"), 1 (\"fp8_e4m3\"), 2 "
                            << "(\"fp8_e5m2\") or 3 (\"fp8_ds_mla\"), got " << code;
  return kCopy;
}

// kv_cache's and out's dtypes for the format.
inline void check_dtypes(const char* op, const TensorView& out, const TensorView& cache, Format f) {
  const DLDataType c = cache.dtype();
  if (f == kCopy) {
    if (!is_copy_dtype(c)) {
      TVM_FFI_THROW(TypeError) << op << ": kv_cache: expected dtype bfloat16, float16, float32, uint8, "
                               << "float8_e4m3fn or float8_e5m2, got " << c;
    }
    check_same_dtype(op, "out", out, c, "kv_cache (kv_cache_dtype='auto' copies)");
    return;
  }
  const bool fp8_ok = (f == kFp8E4M3 && c.code == kDLFloat8_e4m3fn) || (f == kFp8E5M2 && c.code == kDLFloat8_e5m2);
  if (!is_u8(c) && !fp8_ok) {
    const char* need = f == kDsMla ? "a uint8" : f == kFp8E4M3 ? "a float8_e4m3fn or uint8" : "a float8_e5m2 or uint8";
    TVM_FFI_THROW(ValueError) << op << ": kv_cache_dtype: '" << format_name(f) << "' needs " << need
                              << " kv_cache, got " << c;
  }
  if (!is_bf16(out.dtype())) {
    TVM_FFI_THROW(TypeError) << op << ": out: expected dtype bfloat16 (kv_cache_dtype='" << format_name(f)
                             << "' dequantizes to bf16), got " << out.dtype();
  }
}

// out's row width D against the cache entry width W.
inline void check_widths(const char* op, int64_t d, int64_t w, Format f) {
  int64_t want = w;
  if (f == kDsMla) {
    if (w != DsMla::kRecord) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected entries of " << DsMla::kRecord
                                << " bytes (the fp8_ds_mla record), got " << w;
    }
    want = DsMla::kOutDims;
  }
  if (d != want) {
    TVM_FFI_THROW(ValueError) << op << ": out: expected rows of " << want << " elements (kv_cache's entries), got "
                              << d;
  }
}

inline void check_rows_for_reqs(const char* op, const char* name, const TensorView& t, int64_t num_reqs) {
  if (t.size(0) < num_reqs) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected at least " << num_reqs
                              << " rows (cu_seq_lens.numel() - 1), got " << t.size(0);
  }
}

// The per-tensor fp8 scale: a tensor (read on the device) or a value (-1.0 exactly: not given).
inline void parse_scale(const char* op, const Optional<TensorView>& t, double value, DLDevice dev, Format f,
                        GatherParams& p) {
  p.scale_ptr = nullptr;
  p.scale_value = 1.0f;
  if (f != kFp8E4M3 && f != kFp8E5M2) return;
  if (t.has_value()) {
    const TensorView& s = t.value();
    check_device(op, "scale", s, dev, "out");
    if (!(s.dtype().code == kDLFloat && s.dtype().bits == 32 && s.dtype().lanes == 1)) {
      TVM_FFI_THROW(TypeError) << op << ": scale: expected a float32 tensor, got " << s.dtype();
    }
    if (s.numel() != 1) {
      TVM_FFI_THROW(ValueError) << op << ": scale: expected a 1-element tensor, got " << s.numel() << " elements";
    }
    p.scale_ptr = reinterpret_cast<const float*>(data_ptr(s));
    return;
  }
  if (value == -1.0) {
    TVM_FFI_THROW(ValueError) << op << ": scale: required for an fp8 kv_cache_dtype (no default scale)";
  }
  const float v = static_cast<float>(value);
  if (!(v > 0.0f && v <= 3.4028234663852886e38f)) {
    TVM_FFI_THROW(ValueError) << op << ": scale: must be finite and > 0, got " << value;
  }
  p.scale_value = v;
}

}  // namespace detail

inline GatherParams parse_params(const char* op, const TensorView& out, const TensorView& kv_cache,
                                 const TensorView& block_table, const TensorView& cu_seq_lens,
                                 const Optional<TensorView>& seq_starts, int64_t format,
                                 const Optional<TensorView>& scale, double scale_value) {
  namespace d = detail;
  const Format f = d::parse_format(op, format);
  const DLDevice dev = out.device();
  check_device(op, "kv_cache", kv_cache, dev, "out");
  const bool cu_i64 = check_index(op, "cu_seq_lens", cu_seq_lens);
  check_device(op, "cu_seq_lens", cu_seq_lens, dev, "out");
  bool starts_i64 = false;
  if (seq_starts.has_value()) {
    starts_i64 = check_index(op, "seq_starts", seq_starts.value());
    check_device(op, "seq_starts", seq_starts.value(), dev, "out");
  }
  check_device(op, "block_table", block_table, dev, "out");
  d::check_dtypes(op, out, kv_cache, f);
  if (kv_cache.ndim() != 3) {
    TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected shape [num_blocks, block_size, W], got "
                              << shape_str(kv_cache);
  }
  check_last_dim_contiguous(op, "kv_cache", kv_cache);
  if (out.ndim() != 2) {
    TVM_FFI_THROW(ValueError) << op << ": out: expected shape [total_tokens, D], got " << shape_str(out);
  }
  check_last_dim_contiguous(op, "out", out);
  d::check_widths(op, out.size(1), kv_cache.size(2), f);
  const int64_t num_reqs = cu_seq_lens.numel() - 1;
  if (num_reqs < 0) {
    TVM_FFI_THROW(ValueError) << op << ": cu_seq_lens: expected num_reqs + 1 >= 1 entries, got 0";
  }
  const DLDataType bt = block_table.dtype();
  if (bt.code != kDLInt || (bt.bits != 32 && bt.bits != 64) || bt.lanes != 1) {
    TVM_FFI_THROW(TypeError) << op << ": block_table: expected dtype int32 or int64, got " << bt;
  }
  if (block_table.ndim() != 2) {
    TVM_FFI_THROW(ValueError) << op << ": block_table: expected shape [num_reqs, max_blocks], got "
                              << shape_str(block_table);
  }
  check_last_dim_contiguous(op, "block_table", block_table);
  d::check_rows_for_reqs(op, "block_table", block_table, num_reqs);
  if (seq_starts.has_value()) d::check_rows_for_reqs(op, "seq_starts", seq_starts.value(), num_reqs);

  GatherParams p;
  d::parse_scale(op, scale, scale_value, dev, f, p);
  const int64_t ces = elem_bytes(kv_cache.dtype()), oes = elem_bytes(out.dtype());
  p.out = data_ptr(out);
  p.cache = data_ptr(kv_cache);
  p.block_table = data_ptr(block_table);
  p.cu_seq_lens = data_ptr(cu_seq_lens);
  p.seq_starts = seq_starts.has_value() ? data_ptr(seq_starts.value()) : nullptr;
  p.rows = out.size(0);
  p.num_reqs = num_reqs;
  p.out_row_stride = out.stride(0) * oes;
  p.num_blocks = kv_cache.size(0);
  p.block_size = kv_cache.size(1);
  p.block_stride = kv_cache.stride(0) * ces;
  p.token_stride = kv_cache.stride(1) * ces;
  p.bt_row_stride = block_table.stride(0);
  p.max_blocks = block_table.size(1);
  p.entry_bytes = kv_cache.size(2) * ces;
  p.out_row_bytes = out.size(1) * oes;
  p.format = f;
  p.bt_i64 = bt.bits == 64;
  p.cu_i64 = cu_i64;
  p.starts_i64 = starts_i64;
  p.device = dev;
  return p;
}

// ---- The row -> cache entry rule, one function for the CPU kernel and the CUDA kernel.

constexpr int64_t kNotWritten = -2;  // entry_offset: output row t belongs to no request
constexpr int64_t kZeroRow = -1;     // entry_offset: written as zeros

JITKV_HD inline int64_t load_index(const void* p, int64_t i, bool i64) {
#if defined(__CUDA_ARCH__)
  return i64 ? cuda::load(static_cast<const int64_t*>(p) + i) : static_cast<int64_t>(cuda::load(static_cast<const int32_t*>(p) + i));
#else
  return i64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
#endif
}

// Byte offset in the cache of output row t's entry (0 <= t < rows), or kZeroRow / kNotWritten.
// The request is found by binary search over cu_seq_lens (a few hundred bytes that stay in cache).
JITKV_HD inline int64_t entry_offset(const GatherParams& p, int64_t t) {
  if (p.num_reqs <= 0) return kNotWritten;
  int64_t lo = 0, hi = p.num_reqs;  // the answer is in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (load_index(p.cu_seq_lens, mid, p.cu_i64) <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int64_t start = load_index(p.cu_seq_lens, lo, p.cu_i64);
  const int64_t end = load_index(p.cu_seq_lens, lo + 1, p.cu_i64);
  if (t < start || t >= end) return kNotWritten;
  // Wrapping (unsigned) add, as the torch reference's int64 arithmetic: any seq_starts stays defined.
  const int64_t first = p.seq_starts ? load_index(p.seq_starts, lo, p.starts_i64) : 0;
  const int64_t pos = static_cast<int64_t>(static_cast<uint64_t>(t - start) + static_cast<uint64_t>(first));
  if (pos < 0) return kZeroRow;
  int64_t blk, row;
  if (pos <= UINT32_MAX && p.block_size <= UINT32_MAX) {  // 32-bit division: the common case, far cheaper on GPUs
    const uint32_t q = static_cast<uint32_t>(pos) / static_cast<uint32_t>(p.block_size);
    blk = q;
    row = static_cast<uint32_t>(pos) - q * static_cast<uint32_t>(p.block_size);
  } else {
    blk = pos / p.block_size;
    row = pos - blk * p.block_size;
  }
  if (blk >= p.max_blocks) return kZeroRow;
  const int64_t phys = load_index(p.block_table, lo * p.bt_row_stride + blk, p.bt_i64);
  if (phys < 0 || phys >= p.num_blocks) return kZeroRow;
  return phys * p.block_stride + row * p.token_stride;
}

#if defined(__CUDACC__)

// ---- CUDA kernel: one warp per kTok output rows (CTAs of kWarps warps, a grid-stride loop over
// tiles of kWarps * kTok consecutive rows). Lane k < kTok resolves row t0 + k (entry_offset) and the
// warp shares the results; then every lane issues its loads of all kTok entries before the first
// conversion, and writes 16-byte output vectors: output vector j (16 bytes) of a row is lane j % 32's
// register j / 32. A copy reads 16 bytes per vector, a per-tensor fp8 format 8 (8 values), fp8_ds_mla
// 8 e4m3 bytes (nope) or 16 bytes (rope) plus the record's 16 bytes of tile scales, read once per
// lane and row (one broadcast transaction per warp).

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ int64_t shfl64(int64_t v, int src) {
  const int lo = __shfl_sync(kFull, static_cast<int>(v), src);
  const int hi = __shfl_sync(kFull, static_cast<int>(v >> 32), src);
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(hi)) << 32) | static_cast<uint32_t>(lo));
}

// The cache is read once: streaming loads (evict-first), so the output rows the next kernel reads stay in L2.
__device__ __forceinline__ uint4 ld16(const char* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 ld8(const char* p) {
  const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
  return make_uint4(v.x, v.y, 0u, 0u);
}

// One row held by a warp: raw[i] is output vector j = lane + 32 i as loaded from the cache entry.
template <int kFormat, int kOutBytes>
struct RowRegs {
  static_assert(kOutBytes % 16 == 0, "output rows of whole 16-byte vectors");
  static constexpr int kVecs = kOutBytes / 16;
  static constexpr int kIters = (kVecs + 31) / 32;
  static constexpr int kNopeVecs = kFormat == kDsMla ? DsMla::kNope / 8 : kVecs;  // vectors from 8 fp8 bytes
  static_assert(kFormat != kDsMla || kOutBytes == 2 * DsMla::kOutDims, "fp8_ds_mla rows are 576 bf16");
  static_assert(kFormat != kDsMla || (DsMla::kTile % 8 == 0 && DsMla::kScaleAt % 16 == 0 && DsMla::kRopeAt % 16 == 0),
                "fp8_ds_mla record: 16-byte aligned parts, tiles of whole vectors");
  uint4 raw[kIters];
  uint4 scales;  // fp8_ds_mla: the record's tile scales (up to 4 fp32)

  __device__ __forceinline__ void load(const char* entry, bool valid, int lane) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int j = lane + 32 * i;
      raw[i] = make_uint4(0u, 0u, 0u, 0u);
      if (!valid || j >= kVecs) continue;
      if constexpr (kFormat == kCopy) {
        raw[i] = ld16(entry + 16 * j);
      } else if constexpr (kFormat == kDsMla) {
        raw[i] = j < kNopeVecs ? ld8(entry + 8 * j) : ld16(entry + DsMla::kRopeAt + 16 * (j - kNopeVecs));
      } else {
        raw[i] = ld8(entry + 8 * j);
      }
    }
    if constexpr (kFormat == kDsMla) {
      static_assert(DsMla::kNope / DsMla::kTile <= 4, "at most 4 tile scales (one 16-byte load)");
      scales = valid ? ld16(entry + DsMla::kScaleAt) : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  // Converts and writes the row; a zero row (valid false) is written as zeros whatever the scale.
  __device__ __forceinline__ void store(char* out_row, bool valid, float scale, int lane) const {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int j = lane + 32 * i;
      if (j >= kVecs) continue;
      uint4 v = raw[i];
      if constexpr (kFormat == kFp8E4M3 || kFormat == kFp8E5M2) {
        v = cuda::dequant8<kFormat == kFp8E5M2>(v.x, v.y, scale);
      } else if constexpr (kFormat == kDsMla) {
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

template <int kFormat, int kOutBytes>
__global__ void __launch_bounds__(kWarps * 32) gather_mla_cache_kernel(const __grid_constant__ GatherParams p) {
  static_assert(kTok <= 32, "one lane resolves each row of a warp");
  using Row = RowRegs<kFormat, kOutBytes>;
  cuda::warm_params(p, p.rows);
  cuda::pdl_wait();  // the cache, the index tensors and the scale may come from the previous kernel
  cuda::pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float scale = 1.0f;
  if constexpr (kFormat == kFp8E4M3 || kFormat == kFp8E5M2) scale = p.scale_ptr ? cuda::load(p.scale_ptr) : p.scale_value;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps * kTok;
  for (int64_t t0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kTok; t0 < p.rows; t0 += step) {
    int64_t mine = kNotWritten;
    if (lane < kTok && t0 + lane < p.rows) mine = entry_offset(p, t0 + lane);
    int64_t off[kTok];
    Row r[kTok];
#pragma unroll
    for (int k = 0; k < kTok; ++k) {  // every load of the warp in flight before the first conversion
      off[k] = shfl64(mine, k);
      r[k].load(p.cache + (off[k] >= 0 ? off[k] : 0), off[k] >= 0, lane);
    }
#pragma unroll
    for (int k = 0; k < kTok; ++k) {
      if (off[k] != kNotWritten) r[k].store(p.out + (t0 + k) * p.out_row_stride, off[k] >= 0, scale, lane);
    }
  }
}

#endif  // __CUDACC__

}  // namespace jitkv::mla_gather
