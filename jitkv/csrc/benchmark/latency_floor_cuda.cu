// Benchmark-only kernels and their tvm-ffi bindings: the least that a KV write at n = 1 must do under
// the contract, so that each jitkv row can be read against it (python -m jitkv.benchmark).
//  - latency_floor: the fastest copy. One thread waits for the previous kernel (PDL), loads loc[0] and
//    16 source bytes together (one memory round trip), lets the next kernel launch, and stores the
//    bytes at that slot if it is in range: the floor under any set_mla_kv_buffer / store_cache / DSv4
//    writer launch at n = 1.
//  - latency_floor_e4m3: the same thread with one fp8 conversion on the way: the device scale loaded
//    with the slot and the 8 bf16 values, then x / scale -> e4m3 -> 8 bytes stored. `exact` divides as
//    the latency writers do (jitkv/cuda/fp8.cuh quantize8 with Divider); otherwise x * rcp.approx(scale),
//    which no exact division undercuts (it needs the reciprocal and the product at the least).
//  - latency_floor_ds_mla: one warp quantizing two 128-value tiles of an fp8_ds_mla record (lanes
//    0-15 and 16-31, 8 bf16 values each): each lane's largest magnitude (NaN not left out), a
//    redux.sync max per tile, the tile scale amax / 448, the division, the 8-byte stores and lane 0's
//    two scales. `exact` as the MLA writer (jitkv/cuda/fp8.cuh amax_scale, quantize8 with Divider);
//    otherwise amax * (1 / 448) and x * rcp.approx(scale): less than any writer of the record must do.
//  - latency_floor_rope: the fused prologue's least (rope_store_cache, rope_set_mla_kv_buffer at n = 1):
//    one thread waits (PDL), loads loc[0], positions[0] and 8 bf16 source values together, lets the
//    next kernel launch, clamps the position into the table, loads that position's 4 cos and 4 sin
//    float32 values (a second, dependent round trip a plain write does not have), rotates the 4 GPT-J
//    pairs (each product rounded, as docs/design.md §9), rounds to bf16 and stores 16 bytes at the slot.
//  - latency_floor_rope_rows: the fused prologue's least at n tokens, for the bytes it moves: token t's
//    q, k and v bytes read (one source row, contiguous) and its q bytes stored contiguous, its k and v
//    bytes in row slot[t] of k_cache and v_cache; one 16-byte source vector per thread, CTAs of
//    `threads` over a token's vectors. Every thread waits (PDL), loads its token's position (k and v
//    threads also its slot) with its 16 bytes, lets the next kernel launch; a q or k thread then loads
//    16 bytes of that position's cos/sin row, which its store depends on (the dependent round trip).
//    Stores of 16 bytes, or for an fp8 destination (q_dst or the caches half the source's width) the
//    high byte of each bf16 value, less than any conversion. No rotation, no quantization: less than
//    rope_store_cache moves and computes at any n.
// Each floor does no more than the contract demands of its write, so a jitkv kernel cannot run below
// it, and a target under it is beyond the hardware.
#include <cuda_bf16.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

#include "jitkv/check.h"
#include "jitkv/codes.h"
#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/vec.cuh"

namespace {

using jitkv::data_ptr;
using jitkv::codes::DsMla;
using jitkv::codes::KvFormat;
using jitkv::codes::SrcDtype;
using jitkv::cuda::Divider;
using jitkv::cuda::load;
using tvm::ffi::TensorView;

__global__ void latency_floor_kernel(const int64_t* loc, const uint4* src, char* dst, int64_t row_bytes,
                                     int64_t num_rows) {
  if (threadIdx.x != 0) return;
  jitkv::cuda::pdl_wait();
  const int64_t slot = load(loc);
  const uint4 v = load(src);
  jitkv::cuda::pdl_launch_dependents();
  if (slot >= 0 && slot < num_rows) *reinterpret_cast<uint4*>(dst + slot * row_bytes) = v;
}

__device__ __forceinline__ float rcp_approx(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  return r;
}

// The 8 bf16 values of v divided by the scale (kExact: as the latency writers, d(x); else x * r), as 8
// e4m3 bytes.
template <bool kExact>
__device__ __forceinline__ uint2 quantize8(const uint4& v, const Divider& d, float r) {
  if constexpr (kExact) return jitkv::cuda::quantize8<SrcDtype::kBF16, KvFormat::kE4M3>(v, d);
  return jitkv::cuda::quantize8<SrcDtype::kBF16, KvFormat::kE4M3>(v, [r](float x) { return x * r; });
}

template <bool kExact>
__device__ __forceinline__ void divider_of(float s, Divider& d, float& r) {
  if constexpr (kExact)
    d = Divider(s);
  else
    r = rcp_approx(s);
}

template <bool kExact>
__global__ void latency_floor_e4m3_kernel(const int64_t* loc, const uint4* src, const float* scale, char* dst,
                                          int64_t row_bytes, int64_t num_rows) {
  if (threadIdx.x != 0) return;
  jitkv::cuda::pdl_wait();
  const int64_t slot = load(loc);
  const float s = load(scale);
  const uint4 v = load(src);
  jitkv::cuda::pdl_launch_dependents();
  if (slot < 0 || slot >= num_rows) return;
  Divider d;
  float r = 0.0f;
  divider_of<kExact>(s, d, r);
  *reinterpret_cast<uint2*>(dst + slot * row_bytes) = quantize8<kExact>(v, d, r);
}

// A tile's scale from its amax (bf16 bits): kExact as the MLA writer, max(RN(amax / 448), FLT_MIN).
template <bool kExact>
__device__ __forceinline__ float tile_scale(uint32_t amax) {
  if constexpr (kExact) return jitkv::cuda::amax_scale<SrcDtype::kBF16>(amax, DsMla::kFP8Max);
  return __uint_as_float(amax << 16) * (1.0f / DsMla::kFP8Max);
}

template <bool kExact>
__global__ void latency_floor_ds_mla_kernel(const int64_t* loc, const uint4* src, char* dst, int64_t row_bytes,
                                            int64_t num_rows, int64_t scale_offset) {
  const int lane = threadIdx.x & 31;
  jitkv::cuda::pdl_wait();
  const int64_t slot = load(loc);
  const uint4 v = load(src + lane);
  jitkv::cuda::pdl_launch_dependents();
  const uint32_t mx =
      __vmaxu2(__vmaxu2(v.x & 0x7fff7fffu, v.y & 0x7fff7fffu), __vmaxu2(v.z & 0x7fff7fffu, v.w & 0x7fff7fffu));
  const uint32_t amax = max(mx >> 16, mx & 0xffffu);
  const float s0 = tile_scale<kExact>(__reduce_max_sync(0xffffffffu, lane < 16 ? amax : 0u));
  const float s1 = tile_scale<kExact>(__reduce_max_sync(0xffffffffu, lane < 16 ? 0u : amax));
  Divider d;
  float r = 0.0f;
  divider_of<kExact>(lane < 16 ? s0 : s1, d, r);
  const uint2 q = quantize8<kExact>(v, d, r);
  if (slot < 0 || slot >= num_rows) return;
  char* row = dst + slot * row_bytes;
  reinterpret_cast<uint2*>(row)[lane] = q;
  if (lane == 0) *reinterpret_cast<float2*>(row + scale_offset) = make_float2(s0, s1);
}

__global__ void latency_floor_rope_kernel(const int64_t* loc, const int64_t* positions, const uint4* src,
                                          const float* cos_sin, int64_t cs_stride, int64_t half, int64_t max_pos,
                                          char* dst, int64_t row_bytes, int64_t num_rows) {
  if (threadIdx.x != 0) return;
  jitkv::cuda::pdl_wait();
  const int64_t slot = load(loc);
  const int64_t p = load(positions);
  const uint4 v = load(src);
  jitkv::cuda::pdl_launch_dependents();
  const float* row = cos_sin + (p < 0 ? 0 : p >= max_pos ? max_pos - 1 : p) * cs_stride;
  const float4 c = load(reinterpret_cast<const float4*>(row));
  const float4 s = load(reinterpret_cast<const float4*>(row + half));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  const float cs[4] = {c.x, c.y, c.z, c.w}, sn[4] = {s.x, s.y, s.z, s.w};
  uint32_t out[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float a = __uint_as_float(w[m] << 16), b = __uint_as_float(w[m] & 0xffff0000u);
    const float lo = __fsub_rn(__fmul_rn(a, cs[m]), __fmul_rn(b, sn[m]));
    const float hi = __fadd_rn(__fmul_rn(b, cs[m]), __fmul_rn(a, sn[m]));
    out[m] =
        __bfloat16_as_ushort(__float2bfloat16_rn(lo)) | (uint32_t{__bfloat16_as_ushort(__float2bfloat16_rn(hi))} << 16);
  }
  if (slot >= 0 && slot < num_rows) {
    *reinterpret_cast<uint4*>(dst + slot * row_bytes) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

// A 16-byte vector's bits, made to depend on `c` (zero is 0 at run time: the compiler cannot drop c).
__device__ __forceinline__ uint4 depend_on(uint4 v, const uint4& c, uint32_t zero) {
  v.x ^= c.x & zero;
  v.y ^= c.y & zero;
  v.z ^= c.z & zero;
  v.w ^= c.w & zero;
  return v;
}

// Vector `at` of a destination row: 16 bytes, or (kHalf) the high byte of each of its 8 bf16 values.
template <bool kHalf>
__device__ __forceinline__ void store_vec(char* row, int64_t at, const uint4& v) {
  if constexpr (kHalf) {
    reinterpret_cast<uint2*>(row)[at] = make_uint2(__byte_perm(v.x, v.y, 0x7531), __byte_perm(v.z, v.w, 0x7531));
  } else {
    reinterpret_cast<uint4*>(row)[at] = v;
  }
}

struct RopeRows {
  const int64_t *positions, *slots;
  const uint4 *src, *cos_sin;
  char *q_dst, *k_cache, *v_cache;
  int64_t cs_vecs, max_pos, num_slots, in_vecs, q_vecs, kv_vecs;
  uint32_t zero;
};

template <bool kHalfQ, bool kHalfKv>
__global__ void latency_floor_rope_rows_kernel(const __grid_constant__ RopeRows p) {
  const int64_t t = blockIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (i >= p.in_vecs) return;
  const bool is_q = i < p.q_vecs, is_v = i >= p.q_vecs + p.kv_vecs;
  jitkv::cuda::pdl_wait();
  const int64_t pos = load(p.positions + t);
  const int64_t slot = is_q ? 0 : load(p.slots + t);
  uint4 v = load(p.src + t * p.in_vecs + i);
  jitkv::cuda::pdl_launch_dependents();
  if (!is_v) {
    const int64_t row = pos < 0 ? 0 : pos >= p.max_pos ? p.max_pos - 1 : pos;
    v = depend_on(v, load(p.cos_sin + row * p.cs_vecs + i % p.cs_vecs), p.zero);
  }
  if (is_q) {
    store_vec<kHalfQ>(p.q_dst + t * p.q_vecs * (kHalfQ ? 8 : 16), i, v);
    return;
  }
  if (slot < 0 || slot >= p.num_slots) return;
  char* row = (is_v ? p.v_cache : p.k_cache) + slot * p.kv_vecs * (kHalfKv ? 8 : 16);
  store_vec<kHalfKv>(row, i - p.q_vecs - (is_v ? p.kv_vecs : 0), v);
}

bool on_cuda(const TensorView& t) { return t.device().device_type == kDLCUDA; }
int64_t nbytes(const TensorView& t) { return t.numel() * jitkv::elem_bytes(t.dtype()); }

// What every floor takes: dst [rows, >= min_row bytes] with `align`-byte aligned rows, loc int64 [>= 1],
// src of >= src_bytes 16-byte aligned bytes. Returns dst's row stride in bytes.
int64_t check_floor_args(const char* name, const TensorView& dst, const TensorView& loc, const TensorView& src,
                         int64_t min_row, int64_t align, int64_t src_bytes) {
  const int64_t row_bytes = dst.ndim() == 2 ? dst.stride(0) * jitkv::elem_bytes(dst.dtype()) : 0;
  const bool dst_ok = on_cuda(dst) && dst.ndim() == 2 && dst.size(1) * jitkv::elem_bytes(dst.dtype()) >= min_row &&
                      row_bytes % align == 0 && jitkv::aligned16(data_ptr(dst));
  const bool loc_ok = on_cuda(loc) && loc.dtype().code == kDLInt && loc.dtype().bits == 64 && loc.numel() >= 1;
  if (!dst_ok || !loc_ok || !on_cuda(src) || nbytes(src) < src_bytes || !jitkv::aligned16(data_ptr(src))) {
    TVM_FFI_THROW(ValueError) << name << ": expected CUDA tensors dst [rows, >= " << min_row << " bytes] (" << align
                              << "-byte aligned rows), loc int64 [>= 1], src of >= " << src_bytes
                              << " bytes (16-byte aligned)";
  }
  return row_bytes;
}

// Launches kernel<<<grid, block>>>(args...) on dst's device and the caller's stream, with PDL from sm_90.
template <typename... KArgs, typename... Args>
void launch_on(const char* name, const TensorView& dst, dim3 grid, dim3 block, void (*kernel)(KArgs...), Args... args) {
  const int device = dst.device().device_id;
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(device);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  jitkv::cuda::check_launch(name, jitkv::cuda::launch(kernel, grid, block, stream, info.pdl(), args...));
}

// The one-thread floors: kernel<<<1, 32>>>(args...).
template <typename... KArgs, typename... Args>
void launch_floor(const char* name, const TensorView& dst, void (*kernel)(KArgs...), Args... args) {
  launch_on(name, dst, dim3(1), dim3(32), kernel, args...);
}

template <typename T>
const T* ptr_of(const TensorView& t) {
  return reinterpret_cast<const T*>(data_ptr(t));
}

void latency_floor(TensorView dst, TensorView loc, TensorView src) {
  const int64_t row_bytes = check_floor_args("latency_floor", dst, loc, src, 16, 16, 16);
  launch_floor("latency_floor", dst, latency_floor_kernel, ptr_of<int64_t>(loc), ptr_of<uint4>(src), data_ptr(dst),
               row_bytes, dst.size(0));
}

// scale: a float32 tensor of >= 1 element on the device.
void latency_floor_e4m3(TensorView dst, TensorView loc, TensorView src, TensorView scale, bool exact) {
  const int64_t row_bytes = check_floor_args("latency_floor_e4m3", dst, loc, src, 8, 8, 16);
  if (!on_cuda(scale) || scale.dtype().code != kDLFloat || scale.dtype().bits != 32 || scale.numel() < 1) {
    TVM_FFI_THROW(ValueError) << "latency_floor_e4m3: expected a float32 CUDA scale of >= 1 element";
  }
  launch_floor("latency_floor_e4m3", dst, exact ? latency_floor_e4m3_kernel<true> : latency_floor_e4m3_kernel<false>,
               ptr_of<int64_t>(loc), ptr_of<uint4>(src), ptr_of<float>(scale), data_ptr(dst), row_bytes, dst.size(0));
}

// dst rows hold the 256 e4m3 bytes at 0 and the two scales at scale_offset (a multiple of 8, >= 256).
void latency_floor_ds_mla(TensorView dst, TensorView loc, TensorView src, int64_t scale_offset, bool exact) {
  const int64_t row_bytes = check_floor_args("latency_floor_ds_mla", dst, loc, src, 264, 16, 512);
  if (scale_offset < 256 || scale_offset % 8 != 0 || scale_offset + 8 > dst.size(1) * jitkv::elem_bytes(dst.dtype())) {
    TVM_FFI_THROW(ValueError) << "latency_floor_ds_mla: expected a scale_offset of >= 256, a multiple of 8 with 8 "
                              << "bytes in the row, got " << scale_offset;
  }
  launch_floor("latency_floor_ds_mla", dst,
               exact ? latency_floor_ds_mla_kernel<true> : latency_floor_ds_mla_kernel<false>, ptr_of<int64_t>(loc),
               ptr_of<uint4>(src), data_ptr(dst), row_bytes, dst.size(0), scale_offset);
}

// positions int64 [>= 1]; cos_sin_cache float32 [max_pos, rotary_dim >= 8], contiguous rows of a multiple
// of 16 bytes.
void latency_floor_rope(TensorView dst, TensorView loc, TensorView src, TensorView positions,
                        TensorView cos_sin_cache) {
  const int64_t row_bytes = check_floor_args("latency_floor_rope", dst, loc, src, 16, 16, 16);
  const TensorView& cs = cos_sin_cache;
  const bool pos_ok =
      on_cuda(positions) && positions.dtype().code == kDLInt && positions.dtype().bits == 64 && positions.numel() >= 1;
  const bool cs_ok = on_cuda(cs) && cs.dtype().code == kDLFloat && cs.dtype().bits == 32 && cs.ndim() == 2 &&
                     cs.size(1) >= 8 && cs.size(1) % 8 == 0 && cs.stride(1) == 1 && cs.stride(0) % 4 == 0 &&
                     jitkv::aligned16(data_ptr(cs));
  if (!pos_ok || !cs_ok) {
    TVM_FFI_THROW(ValueError) << "latency_floor_rope: expected CUDA positions int64 [>= 1] and a float32 "
                              << "cos_sin_cache [max_pos, rotary_dim >= 8] with 16-byte aligned rows";
  }
  launch_floor("latency_floor_rope", dst, latency_floor_rope_kernel, ptr_of<int64_t>(loc), ptr_of<int64_t>(positions),
               ptr_of<uint4>(src), ptr_of<float>(cs), cs.stride(0), cs.size(1) / 2, cs.size(0), data_ptr(dst),
               row_bytes, dst.size(0));
}

bool dense_bytes(const TensorView& t, int64_t rows, int64_t width) {
  return on_cuda(t) && t.ndim() == 2 && (rows < 0 || t.size(0) == rows) && t.size(1) == width &&
         t.dtype().code == kDLUInt && t.dtype().bits == 8 && t.stride(1) == 1 && t.stride(0) == width &&
         jitkv::aligned16(data_ptr(t));
}

// src uint8 [n, q_bytes + 2 * kv_bytes] (q, k, v), q_dst uint8 [n, q_bytes or q_bytes / 2], k_cache
// and v_cache uint8 [num_slots, kv_bytes or kv_bytes / 2] (a half: an fp8 destination; every width a
// multiple of 16, every tensor contiguous and 16-byte aligned), slots and positions int64 [n],
// cos_sin_cache float32 [max_pos, width] contiguous (width a multiple of 4), threads in 32..1024.
void latency_floor_rope_rows(TensorView q_dst, TensorView k_cache, TensorView v_cache, TensorView slots, TensorView src,
                             TensorView positions, TensorView cos_sin_cache, int64_t q_bytes, int64_t threads) {
  const int64_t n = positions.numel();
  const TensorView& cs = cos_sin_cache;
  const int64_t in_bytes = src.ndim() == 2 ? src.size(1) : 0, kv_bytes = (in_bytes - q_bytes) / 2;
  const bool half_q = q_dst.ndim() == 2 && 2 * q_dst.size(1) == q_bytes;
  const bool half_kv = k_cache.ndim() == 2 && 2 * k_cache.size(1) == kv_bytes;
  const int64_t rq = half_q ? 2 : 1, rkv = half_kv ? 2 : 1;
  const auto index_ok = [n](const TensorView& t) {
    return on_cuda(t) && t.dtype().code == kDLInt && t.dtype().bits == 64 && t.ndim() == 1 && t.size(0) == n;
  };
  const bool cs_ok = on_cuda(cs) && cs.dtype().code == kDLFloat && cs.dtype().bits == 32 && cs.ndim() == 2 &&
                     cs.size(1) % 4 == 0 && cs.stride(1) == 1 && cs.stride(0) == cs.size(1) &&
                     jitkv::aligned16(data_ptr(cs));
  const bool widths_ok =
      q_bytes > 0 && q_bytes % 32 == 0 && kv_bytes > 0 && kv_bytes % 32 == 0 && in_bytes == q_bytes + 2 * kv_bytes;
  if (n < 1 || !index_ok(positions) || !index_ok(slots) || !cs_ok || !widths_ok || !dense_bytes(src, n, in_bytes) ||
      !dense_bytes(q_dst, n, q_bytes / rq) || !dense_bytes(k_cache, -1, kv_bytes / rkv) ||
      !dense_bytes(v_cache, k_cache.size(0), kv_bytes / rkv) || threads < 32 || threads > 1024) {
    TVM_FFI_THROW(ValueError) << "latency_floor_rope_rows: expected CUDA positions and slots int64 [n >= 1], src "
                              << "uint8 [n, q_bytes + 2 kv_bytes], q_dst uint8 [n, q_bytes or q_bytes / 2], k_cache "
                              << "and v_cache uint8 [num_slots, kv_bytes or kv_bytes / 2] (contiguous, widths "
                              << "multiples of 32 in the source), a contiguous float32 cos_sin_cache [max_pos, 4k], "
                              << "threads in 32..1024";
  }
  RopeRows p{ptr_of<int64_t>(positions),
             ptr_of<int64_t>(slots),
             ptr_of<uint4>(src),
             ptr_of<uint4>(cs),
             static_cast<char*>(data_ptr(q_dst)),
             static_cast<char*>(data_ptr(k_cache)),
             static_cast<char*>(data_ptr(v_cache)),
             cs.size(1) / 4,
             cs.size(0),
             k_cache.size(0),
             in_bytes / 16,
             q_bytes / 16,
             kv_bytes / 16,
             0u};
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>((p.in_vecs + threads - 1) / threads));
  auto* kernel =
      half_q ? (half_kv ? latency_floor_rope_rows_kernel<true, true> : latency_floor_rope_rows_kernel<true, false>)
             : (half_kv ? latency_floor_rope_rows_kernel<false, true> : latency_floor_rope_rows_kernel<false, false>);
  launch_on("latency_floor_rope_rows", q_dst, grid, dim3(static_cast<unsigned>(threads)), kernel, p);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(latency_floor, latency_floor);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(latency_floor_rope_rows, latency_floor_rope_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(latency_floor_rope, latency_floor_rope);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(latency_floor_e4m3, latency_floor_e4m3);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(latency_floor_ds_mla, latency_floor_ds_mla);
