// DeepSeek-V3.2 sparse-attention indexer K cache (docs/design.md §5.1): the writer
// indexer_k_quant_and_cache and the gather gather_indexer_k_quant_cache.
//
// The family's parameter blocks and their argument parsers, shared by the CUDA binding
// (indexer_k_cache_cuda.cu) and the CPU binding (indexer_k_cache_cpu.cpp, which sees only this host
// part), then the CUDA kernels (compiled by nvcc only).
//
// Layout (the numbers are build arguments from jitkv/layouts.py): a block of block_size tokens holds
// every token's kHeadDim e4m3 bytes (token t at byte t * kHeadDim), then every token's fp32 scale
// (token t at block_size * kHeadDim + t * 4); the block stride is the cache's stride(0).
//
// Quantization of one token: amax = max |x| over its kHeadDim values, NaN elements ignored; scale =
// max(amax, kAmaxMin) / kFp8Max (a true fp32 division); "ue8m0" rounds the scale up to a power of two
// on its bits (exponent + 1 when the mantissa is not zero: exact, no log2); stored = e4m3(x / scale)
// with round-to-nearest-even and saturation to +-448, which is torch's clamp-then-convert.
#pragma once

#include <cstdint>

#include "jitkv/check.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "jitkv/cuda/launch.cuh"
#endif

#if !defined(JITKV_HEAD_DIM) || !defined(JITKV_SCALE_BYTES) || !defined(JITKV_FP8_MAX) || !defined(JITKV_AMAX_MIN)
#error "indexer_k_cache.cuh needs -DJITKV_HEAD_DIM, -DJITKV_SCALE_BYTES, -DJITKV_FP8_MAX and -DJITKV_AMAX_MIN"
#endif

#if defined(__CUDACC__)
#define JITKV_HOST_DEVICE __host__ __device__
#else
#define JITKV_HOST_DEVICE
#endif

namespace jitkv::indexer {

constexpr int64_t kHeadDim = JITKV_HEAD_DIM;
constexpr int64_t kScaleBytes = JITKV_SCALE_BYTES;
constexpr int64_t kTokenBytes = kHeadDim + kScaleBytes;
constexpr float kFp8Max = JITKV_FP8_MAX;
constexpr float kAmaxMin = JITKV_AMAX_MIN;
static_assert(kScaleBytes == 4, "one fp32 scale per token");

// scale_fmt codes (ops/indexer.py maps the strings).
enum ScaleFmt : int64_t { kScaleFloat = 0, kScaleUe8m0 = 1 };

// Writer. Shapes: k [n', kHeadDim] bf16/fp16 (n' >= n = slot_mapping.numel(), any row stride); the
// cache as parse_cache takes it. k_f16 and the slot type pick the kernel; device is for the host.
struct WriteParams {
  const char* k;
  char* cache;
  const void* slots;
  int64_t n, k_row_stride, block_stride, block_size, num_slots;  // strides: bytes
  int32_t slot_i64, ue8m0;
  int32_t k_f16;  // 0: bf16
  DLDevice device;
};

// Gather. dst_k [T, kHeadDim] uint8/e4m3; dst_scale [T] or [T, 1] float32, or [T, 4] uint8;
// block_table [batch, max_blocks] int32; cu_seq_lens [batch + 1] int32.
struct GatherParams {
  const char* cache;
  char* dst_k;
  char* dst_scale;
  const int32_t* block_table;
  const int32_t* cu_seq_lens;
  int64_t num_tokens, batch, max_blocks, bt_row_stride;  // bt_row_stride: elements
  int64_t block_stride, block_size, num_blocks, dst_k_stride, dst_scale_stride;  // strides: bytes
  DLDevice device;
};

struct CacheGeom {
  char* base;
  int64_t num_blocks, block_stride;
};

// A uint8 cache for block_size: [num_blocks, W] with block_size * 132 <= W < (block_size + 1) * 132, or a
// [num_blocks, block_size, 132] view; block stride stride(0) a multiple of 4 (the fp32 scales) and at
// least block_size * 132; a 4-byte aligned base. The same rules and messages as
// INDEXER_K_CACHE.validate (ops/indexer.py).
inline CacheGeom parse_cache(const char* op, const TensorView& c, int64_t block_size) {
  if (block_size < 1) {
    TVM_FFI_THROW(ValueError) << op << ": block_size: expected a positive int, got " << block_size;
  }
  const DLDataType dt = c.dtype();
  if (!(dt.code == kDLUInt && dt.bits == 8 && dt.lanes == 1)) {
    TVM_FFI_THROW(TypeError) << op << ": kv_cache: expected dtype uint8, got " << dt;
  }
  const int64_t used = block_size * kTokenBytes;
  if (c.ndim() == 2) {
    if (c.size(1) / kTokenBytes != block_size) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache: blocks of " << c.size(1) << " bytes hold "
                                << c.size(1) / kTokenBytes << " tokens of " << kTokenBytes
                                << " bytes, but block_size is " << block_size << " (expected [num_blocks, W] with "
                                << used << " <= W < " << used + kTokenBytes << "), got shape " << shape_str(c);
    }
  } else if (c.ndim() == 3) {
    if (c.size(1) != block_size || c.size(2) != kTokenBytes) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected [num_blocks, " << block_size << ", " << kTokenBytes
                                << "] for block_size " << block_size << ", got " << shape_str(c);
    }
    if (block_size > 1 && c.stride(1) != kTokenBytes) {
      TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected stride(1) = " << kTokenBytes
                                << " (tokens packed in a block), got " << c.stride(1);
    }
  } else {
    TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected a 2-D [num_blocks, block_stride] or 3-D [num_blocks, "
                              << "block_size, " << kTokenBytes << "] tensor, got " << shape_str(c);
  }
  check_last_dim_contiguous(op, "kv_cache", c);
  const int64_t stride = c.stride(0);
  if (c.size(0) > 1 && (stride < used || stride % kScaleBytes != 0)) {  // one block: no stride
    TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected stride(0) (the block stride in bytes) to be a multiple of "
                              << kScaleBytes << " and >= block_size * " << kTokenBytes << " = " << used << ", got "
                              << stride;
  }
  char* base = data_ptr(c);
  if (reinterpret_cast<uintptr_t>(base) % kScaleBytes != 0) {
    TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected a " << kScaleBytes << "-byte aligned data pointer";
  }
  return CacheGeom{base, c.size(0), stride};
}

inline bool is_dtype(DLDataType d, uint8_t code, int bits) { return d.code == code && d.bits == bits && d.lanes == 1; }

inline WriteParams parse_write(const char* op, const TensorView& k, const TensorView& kv_cache,
                               const TensorView& slot_mapping, int64_t block_size, int64_t scale_fmt) {
  const CacheGeom g = parse_cache(op, kv_cache, block_size);
  const DLDevice dev = kv_cache.device();
  const bool slot_i64 = check_index(op, "slot_mapping", slot_mapping);
  check_device(op, "slot_mapping", slot_mapping, dev, "kv_cache");
  check_device(op, "k", k, dev, "kv_cache");
  const DLDataType kt = k.dtype();
  if (!is_dtype(kt, kDLBfloat, 16) && !is_dtype(kt, kDLFloat, 16)) {
    TVM_FFI_THROW(TypeError) << op << ": k: expected dtype bfloat16 or float16, got " << kt;
  }
  if (k.ndim() != 2 || k.size(1) != kHeadDim) {
    TVM_FFI_THROW(ValueError) << op << ": k: expected shape [n', " << kHeadDim << "], got " << shape_str(k);
  }
  check_last_dim_contiguous(op, "k", k);
  const int64_t n = slot_mapping.numel();
  check_rows_at_least(op, "k", k, n, "slot_mapping");
  if (scale_fmt != kScaleFloat && scale_fmt != kScaleUe8m0) {
    TVM_FFI_THROW(ValueError) << op << ": scale_fmt: expected code 0 (None) or 1 ('ue8m0'), got " << scale_fmt;
  }
  WriteParams p;
  p.k = data_ptr(k);
  p.cache = g.base;
  p.slots = data_ptr(slot_mapping);
  p.n = n;
  p.k_row_stride = k.stride(0) * 2;
  p.block_stride = g.block_stride;
  p.block_size = block_size;
  p.num_slots = g.num_blocks * block_size;
  p.slot_i64 = slot_i64;
  p.ue8m0 = scale_fmt == kScaleUe8m0;
  p.k_f16 = kt.code == kDLFloat;
  p.device = dev;
  return p;
}

// An int32 tensor with `rank` dims on dev whose last dim is contiguous.
inline void check_int32(const char* op, const char* name, const TensorView& t, DLDevice dev, int rank,
                        const char* want_shape) {
  check_device(op, name, t, dev, "kv_cache");
  if (!is_dtype(t.dtype(), kDLInt, 32)) {
    TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected dtype int32, got " << t.dtype();
  }
  if (t.ndim() != rank) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected shape " << want_shape << ", got " << shape_str(t);
  }
  check_last_dim_contiguous(op, name, t);
}

// dst_scale: float32 [T] or [T, 1], or uint8 [T, 4] (vLLM's); returns its row stride in bytes.
inline int64_t parse_dst_scale(const char* op, const TensorView& s, DLDevice dev, int64_t num_tokens) {
  check_device(op, "dst_scale", s, dev, "kv_cache");
  const DLDataType dt = s.dtype();
  const bool f32 = is_dtype(dt, kDLFloat, 32);
  if (!f32 && !is_dtype(dt, kDLUInt, 8)) {
    TVM_FFI_THROW(TypeError) << op << ": dst_scale: expected dtype float32 or uint8, got " << dt;
  }
  const bool ok = s.ndim() >= 1 && s.size(0) == num_tokens &&
                  (f32 ? s.ndim() == 1 || (s.ndim() == 2 && s.size(1) == 1)
                       : s.ndim() == 2 && s.size(1) == kScaleBytes);
  if (!ok) {
    TVM_FFI_THROW(ValueError) << op << ": dst_scale: expected shape [T] or [T, 1] (float32) or [T, " << kScaleBytes
                              << "] (uint8) with T = dst_k.shape[0] = " << num_tokens << ", got " << shape_str(s);
  }
  check_last_dim_contiguous(op, "dst_scale", s);
  return s.stride(0) * elem_bytes(dt);
}

inline GatherParams parse_gather(const char* op, const TensorView& kv_cache, const TensorView& dst_k,
                                 const TensorView& dst_scale, const TensorView& block_table,
                                 const TensorView& cu_seq_lens, int64_t block_size) {
  const CacheGeom g = parse_cache(op, kv_cache, block_size);
  const DLDevice dev = kv_cache.device();
  check_device(op, "dst_k", dst_k, dev, "kv_cache");
  const DLDataType kt = dst_k.dtype();
  if (!is_dtype(kt, kDLUInt, 8) && !is_dtype(kt, kDLFloat8_e4m3fn, 8)) {
    TVM_FFI_THROW(TypeError) << op << ": dst_k: expected dtype uint8 or float8_e4m3fn, got " << kt;
  }
  if (dst_k.ndim() != 2 || dst_k.size(1) != kHeadDim) {
    TVM_FFI_THROW(ValueError) << op << ": dst_k: expected shape [num_tokens, " << kHeadDim << "], got "
                              << shape_str(dst_k);
  }
  check_last_dim_contiguous(op, "dst_k", dst_k);
  const int64_t num_tokens = dst_k.size(0);
  const int64_t scale_stride = parse_dst_scale(op, dst_scale, dev, num_tokens);
  check_int32(op, "block_table", block_table, dev, 2, "[batch, max_blocks]");
  check_int32(op, "cu_seq_lens", cu_seq_lens, dev, 1, "[batch + 1]");
  if (cu_seq_lens.size(0) != block_table.size(0) + 1) {
    TVM_FFI_THROW(ValueError) << op << ": cu_seq_lens: expected " << block_table.size(0) + 1
                              << " entries (block_table.shape[0] + 1), got " << cu_seq_lens.size(0);
  }
  GatherParams p;
  p.cache = g.base;
  p.dst_k = data_ptr(dst_k);
  p.dst_scale = data_ptr(dst_scale);
  p.block_table = reinterpret_cast<const int32_t*>(data_ptr(block_table));
  p.cu_seq_lens = reinterpret_cast<const int32_t*>(data_ptr(cu_seq_lens));
  p.num_tokens = num_tokens;
  p.batch = block_table.size(0);
  p.max_blocks = block_table.size(1);
  p.bt_row_stride = block_table.stride(0);
  p.block_stride = g.block_stride;
  p.block_size = block_size;
  p.num_blocks = g.num_blocks;
  p.dst_k_stride = dst_k.stride(0);
  p.dst_scale_stride = scale_stride;
  p.device = dev;
  return p;
}

// The request covering token t: the last b with cu_seq_lens[b] <= t (a binary search over the batch + 1
// entries, as torch.searchsorted(right=True) - 1), if b < batch; else -1 (t before the first or past
// the last request). start receives cu_seq_lens[b]. cu_seq_lens must be non-decreasing.
template <typename Load>
JITKV_HOST_DEVICE inline int64_t request_of(int64_t t, int64_t batch, Load cu, int64_t& start) {
  int64_t lo = 0, hi = batch + 1;
  start = 0;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    const int64_t c = cu(mid);
    if (c <= t) {
      lo = mid + 1;
      start = c;
    } else {
      hi = mid;
    }
  }
  return lo >= 1 && lo <= batch ? lo - 1 : -1;
}

#if defined(__CUDACC__)

constexpr int kGatherWarps = 4;  // warps per gather CTA; a warp takes 4 tokens, 8 lanes each
constexpr int kGatherLanes = 8;  // lanes per token: 16 bytes each
static_assert(kHeadDim == 16 * 8, "the writer maps a token's values to 16 lanes x 8 values");
static_assert(kHeadDim == kGatherLanes * 16, "the gather maps a token's bytes to 8 lanes x 16 bytes");

// The magnitude bits of the 2 halves of a word (bf16 or fp16), a NaN half counting as 0. A magnitude m
// is NaN iff m + kToSign reaches bit 15 (m > 0x7F80 for bf16, > 0x7C00 for fp16); no carry crosses
// into the other half.
template <bool kF16>
__device__ __forceinline__ uint32_t magnitude2(uint32_t w) {
  constexpr uint32_t kToSign = kF16 ? 0x03FF03FFu : 0x007F007Fu;
  const uint32_t m = w & 0x7FFF7FFFu;
  const uint32_t nan = ((m + kToSign) & 0x80008000u) >> 15;  // 1 in the low bit of each NaN half
  return m & ~(nan * 0xFFFFu);
}

template <bool kF16>
__device__ __forceinline__ float half_to_float(uint32_t h) {
  if constexpr (kF16) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
  } else {
    return __uint_as_float(h << 16);
  }
}

// 8 values (one 16-byte vector) -> 8 e4m3 bytes: x / scale (kUe8m0: x * 2^-e, the same exact quotient)
// converted with round-to-nearest-even and saturation (NaN -> 0x7F).
template <bool kF16, bool kUe8m0>
__device__ __forceinline__ uint2 quantize8(uint4 x, float scale) {
  const float inv = __frcp_rn(scale);  // exact for a power of two (ue8m0), 0 for inf
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[2] = {0u, 0u};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float lo = half_to_float<kF16>(w[j] & 0xFFFFu), hi = half_to_float<kF16>(w[j] >> 16);
    const float2 y = kUe8m0 ? make_float2(__fmul_rn(lo, inv), __fmul_rn(hi, inv))
                            : make_float2(__fdiv_rn(lo, scale), __fdiv_rn(hi, scale));
    const uint32_t b = __nv_cvt_float2_to_fp8x2(y, __NV_SATFINITE, __NV_E4M3);  // y.x in the low byte
    out[j / 2] |= b << (16 * (j % 2));
  }
  return make_uint2(out[0], out[1]);
}

// Writer: half a warp per token, a grid of ceil(n / 2) warps. Lane l of a half holds values
// [8l, 8l + 8) (one 16-byte load; the half reads the row's 256 bytes in one coalesced request). After
// the PDL wait the slot load and the row load go out together (rows of padding tokens < n exist and are
// read, never written), the next kernel may launch, four xor-shuffles give the half its amax, and a
// kept token's 16 lanes store 8 bytes each (one 128-byte line) while lane 0 stores the scale.
template <bool kF16, typename TIdx>
__global__ void __launch_bounds__(256) indexer_write_kernel(const __grid_constant__ WriteParams p) {
  cuda::warm_params(p, p.n);
  const int lane = threadIdx.x & 31, hl = lane & 15;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (2 * pair >= p.n) return;  // the whole warp: no shuffle is left waiting
  const int64_t token = 2 * pair + (lane >> 4);
  const bool real = token < p.n;  // false for the second half of the last warp when n is odd
  const char* src = p.k + token * p.k_row_stride + hl * 16;
  cuda::pdl_wait();  // k and slot_mapping may come from the previous kernel
  int64_t slot = -1;
  uint4 x = make_uint4(0u, 0u, 0u, 0u);
  if (real) {
    slot = static_cast<int64_t>(cuda::load(static_cast<const TIdx*>(p.slots) + token));
    x = cuda::load(reinterpret_cast<const uint4*>(src));
  }
  cuda::pdl_launch_dependents();  // after the loads, as set_mla_kv_buffer's latency kernel
  // Slot < 0 fails the unsigned range check; out-of-range slots are never written.
  const bool keep = static_cast<uint64_t>(slot) < static_cast<uint64_t>(p.num_slots);
  char* block = nullptr;
  int64_t row = 0;
  if (keep) {  // a 64-bit division while the row is in flight
    const int64_t blk = slot / p.block_size;
    row = slot - blk * p.block_size;
    block = p.cache + blk * p.block_stride;
    // The 4-byte scale store is a partial 32-byte sector: with the sector already in L2 it is
    // written back whole instead of merged in DRAM (the DSv4 writer measured 10 % at n = 65,536,
    // dsv4_cuda.cu).
    if (hl == 0) asm volatile("prefetch.global.L2 [%0];" ::"l"(block + p.block_size * kHeadDim + row * kScaleBytes));
  }
  uint32_t m2 = __vmaxu2(__vmaxu2(magnitude2<kF16>(x.x), magnitude2<kF16>(x.y)),
                         __vmaxu2(magnitude2<kF16>(x.z), magnitude2<kF16>(x.w)));
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) m2 = __vmaxu2(m2, __shfl_xor_sync(0xFFFFFFFFu, m2, o));  // within the half
  const float amax = half_to_float<kF16>(max(m2 & 0xFFFFu, m2 >> 16));
  float scale = __fdiv_rn(fmaxf(amax, kAmaxMin), kFp8Max);
  if (p.ue8m0) scale = __uint_as_float((__float_as_uint(scale) + 0x7FFFFFu) & 0x7F800000u);
  if (!keep) return;
  const uint2 q = p.ue8m0 ? quantize8<kF16, true>(x, scale) : quantize8<kF16, false>(x, scale);
  *reinterpret_cast<uint2*>(block + row * kHeadDim + hl * 8) = q;
  if (hl == 0) *reinterpret_cast<float*>(block + p.block_size * kHeadDim + row * kScaleBytes) = scale;
}

// Gather: 8 lanes per token (16 bytes each), 4 tokens per warp, a grid sized from dst_k.shape[0]. Each
// lane finds its token's request (binary search over cu_seq_lens), the block-table entry and copies its
// 16 bytes; lane 0 of the 8 copies the scale. Zero bytes for an invalid block; rows no request covers
// are left alone.
__global__ void __launch_bounds__(kGatherWarps * 32) indexer_gather_kernel(const __grid_constant__ GatherParams p) {
  cuda::warm_params(p, p.num_tokens);
  const int lane = threadIdx.x & 31, sub = lane % kGatherLanes;
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * kGatherWarps + (threadIdx.x >> 5)) * (32 / kGatherLanes) +
                    lane / kGatherLanes;
  char* dst_k = p.dst_k + t * p.dst_k_stride + sub * 16;
  char* dst_scale = p.dst_scale + t * p.dst_scale_stride;
  cuda::pdl_wait();  // the cache, block table and cu_seq_lens may come from the previous kernel
  cuda::pdl_launch_dependents();
  if (t >= p.num_tokens) return;
  int64_t start;
  const int64_t b = request_of(t, p.batch, [&](int64_t i) { return static_cast<int64_t>(cuda::load(p.cu_seq_lens + i)); },
                               start);
  if (b < 0) return;
  const int64_t i = t - start, j = i / p.block_size;
  const int64_t phys = j < p.max_blocks ? static_cast<int64_t>(cuda::load(p.block_table + b * p.bt_row_stride + j)) : -1;
  uint4 data = make_uint4(0u, 0u, 0u, 0u);
  uint32_t scale = 0;
  if (phys >= 0 && phys < p.num_blocks) {
    const char* block = p.cache + phys * p.block_stride;
    const int64_t pos = i - j * p.block_size;
    data = cuda::load(reinterpret_cast<const uint4*>(block + pos * kHeadDim + sub * 16));
    if (sub == 0) scale = cuda::load(reinterpret_cast<const unsigned*>(block + p.block_size * kHeadDim + pos * kScaleBytes));
  }
  *reinterpret_cast<uint4*>(dst_k) = data;
  if (sub == 0) *reinterpret_cast<uint32_t*>(dst_scale) = scale;
}

#endif  // __CUDACC__

}  // namespace jitkv::indexer
