// rope's device arithmetic (docs/design.md §9) on a lane group: a head of D values held by G lanes (G a
// power of two <= 32), lane j holding kV values (16 source bytes) as float32; lanes j >= D / kV hold
// zeros and store nothing. All of it is the reference's order, rounded at the same places: the squares
// summed in groups of 8 then folded by halves (gather_fold: every lane folds all the group sums itself),
// IEEE division, square root and reciprocal (rcp_sqrt_rn), and every product rounded before its sum
// (__fmul_rn, __fadd_rn, __fsub_rn: nvcc contracts a * b + c into an FMA otherwise).
//
// Which values a lane holds (LaneRotation): [j kV, (j + 1) kV), except NeoX's split lanes, where a
// rotated lane j holds [j kV/2, (j + 1) kV/2) and the same h = rotary_dim / 2 further, so that both
// halves of its pairs are its own (16-bit values, split_lanes); NeoX of 32-bit values exchanges halves
// between lanes j and j +- h / kV (h a multiple of kV: the op's CUDA variant requires it, ops/rope.py
// cuda_takes). GPT-J pairs lie inside a lane.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "jitkv/codes.h"
#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/src.cuh"
#include "jitkv/cuda/vec.cuh"

namespace jitkv::rope {

using codes::KvFormat;
using codes::SrcDtype;

template <SrcDtype kSrc>
constexpr int elem_bytes_of() {
  return kSrc == SrcDtype::kF32 ? 4 : 2;
}

// Values per lane: 16 source bytes.
template <SrcDtype kSrc>
constexpr int lane_values() {
  return 16 / elem_bytes_of<kSrc>();
}

constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

// The mask of the G lanes of this lane's group (G = 32: the warp).
template <int G>
__device__ __forceinline__ unsigned group_mask() {
  if constexpr (G == 32) {
    return 0xffffffffu;
  } else {
    return ((1u << G) - 1u) << ((threadIdx.x & 31u) & ~unsigned(G - 1));
  }
}

// N consecutive values of dtype kT at p as float32 (N * size bytes: 4, 8, 16 or 32, aligned to that
// size or to 16).
template <SrcDtype kT, int N>
__device__ __forceinline__ void load_floats(const char* p, float (&out)[N]) {
  constexpr int kBytes = N * elem_bytes_of<kT>();
  const cuda::Pack<kBytes> v = cuda::load_pack<kBytes>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = cuda::SrcTraits<kT>::at(v.w, i);
}

// A lane's 16 source bytes as float32.
template <SrcDtype kSrc>
__device__ __forceinline__ void to_floats(const cuda::Pack<16>& v, float (&x)[lane_values<kSrc>()]) {
#pragma unroll
  for (int i = 0; i < lane_values<kSrc>(); ++i) x[i] = cuda::SrcTraits<kSrc>::at(v.w, i);
}

// The fixed-order sum of P values (a[i] + a[i + half] for half = P / 2, ..., 1), value k held by the
// kStride lanes from k kStride of the group: every lane gathers all P at once (independent shuffles,
// their latencies overlapping, where a butterfly waits for log2 P rounds one after another) and folds
// them itself, so every lane gets the same bits (docs/performance.md "rope norm in one round").
template <int P, int kStride, int G>
__device__ __forceinline__ float gather_fold(float g, unsigned mask) {
  static_assert(is_pow2(P) && P * kStride <= G, "P values of the group's lanes");
  if constexpr (P == 1) {
    return g;
  } else {
    float a[P];
#pragma unroll
    for (int k = 0; k < P; ++k) a[k] = __shfl_sync(mask, g, k * kStride, G);
#pragma unroll
    for (int half = P / 2; half >= 1; half /= 2) {
#pragma unroll
      for (int i = 0; i < half; ++i) a[i] = __fadd_rn(a[i], a[i + half]);
    }
    return a[0];
  }
}

// The group's sum of squares in the fixed order (every lane gets it).
template <int kV, int G>
__device__ __forceinline__ float sum_squares(const float (&x)[kV], unsigned mask) {
  static_assert(kV == 8 || kV == 4, "a lane holds one group of 8 values or half of one");
  float s[kV];
#pragma unroll
  for (int i = 0; i < kV; ++i) s[i] = __fmul_rn(x[i], x[i]);
  float g;
  if constexpr (kV == 8) {
    g = __fadd_rn(__fadd_rn(__fadd_rn(s[0], s[4]), __fadd_rn(s[2], s[6])),
                  __fadd_rn(__fadd_rn(s[1], s[5]), __fadd_rn(s[3], s[7])));
  } else {  // the group's 8 values lie in lanes 2m (s0..s3) and 2m + 1 (s4..s7): t_j = s_j + s_{j+4}
    float t[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) t[j] = __fadd_rn(s[j], __shfl_xor_sync(mask, s[j], 1));
    g = __fadd_rn(__fadd_rn(t[0], t[2]), __fadd_rn(t[1], t[3]));
  }
  constexpr int kLanesPerGroup = 8 / kV;
  return gather_fold<G / kLanesPerGroup, kLanesPerGroup, G>(g, mask);
}

// Whether a rotation's lanes are split (LaneRotation kSplit): NeoX of 16-bit values. 32-bit values (4 a
// lane) exchange halves: split, their fp8 halves would be 2-byte stores.
constexpr bool split_lanes(bool neox, int kv) { return neox && kv == 8; }

// The rotation of a lane of the head: which cos/sin entries it reads, which values it holds, its partner
// lane. NeoX lanes either exchange halves (kSplit false: lane j holds kV consecutive values, its partner
// j +- h / kV the other half's) or hold both halves' values themselves (kSplit: a rotated lane j holds
// [j kV/2, (j + 1) kV/2) and the same h further, as two kV/2 pieces; no shuffle).
template <int kRot, bool kNeox, int kV, bool kSplit = false>
struct LaneRotation {
  static_assert(!kSplit || split_lanes(kNeox, kV), "split lanes: NeoX, 16-bit values");
  static constexpr bool kIsNeox = kNeox, kSplitLanes = kSplit;
  static constexpr int kValues = kV;  // values a lane holds
  static constexpr int kHalf = kRot / 2;
  static constexpr int kHalfLanes = kHalf / kV;  // NeoX: lanes per half
  // Rotated dims in whole lanes, NeoX halves too (ops/rope.py cuda_refusal); a kernel instantiates only
  // the rotations its build can take.
  static constexpr bool kOk = kRot % kV == 0 && (!kNeox || kHalf % kV == 0);
  static constexpr int kRotLanes = kRot / kV;
  static constexpr int kCs = kNeox && !kSplit ? kV : kV / 2;  // cos (and sin) values a rotated lane reads

  // Index of the first cos value lane j reads.
  __device__ __forceinline__ static int cos_index(int j) {
    if constexpr (kNeox && !kSplit) {
      return j < kHalfLanes ? j * kV : (j - kHalfLanes) * kV;
    } else {
      return j * kV / 2;
    }
  }

  // Whether lane j holds two pieces (kSplit's rotated lanes).
  __device__ __forceinline__ static bool split(int j) { return kSplit && j < kRotLanes; }
  // Element index of lane j's first kV / 2 values and of its second.
  __device__ __forceinline__ static int first(int j) { return split(j) ? j * (kV / 2) : j * kV; }
  __device__ __forceinline__ static int second(int j) { return split(j) ? kHalf + j * (kV / 2) : j * kV + kV / 2; }
};

// The LaneRotation the kernels use for a rotation: split lanes where split_lanes allows them.
template <int kRot, bool kNeox, int kV>
using LaneRotationFor = LaneRotation<kRot, kNeox, kV, split_lanes(kNeox, kV)>;

// Lane j's kV values of a row of kEs-byte elements at base: one load, or (split lanes) two.
template <class R, int kEs>
__device__ __forceinline__ cuda::Pack<R::kValues * kEs> load_lane(const char* base, int j) {
  constexpr int kV = R::kValues, kHalfBytes = kV * kEs / 2;
  if constexpr (R::kSplitLanes) {
    if (R::split(j)) {
      const cuda::Pack<kHalfBytes> a = cuda::load_pack<kHalfBytes>(base + R::first(j) * kEs);
      const cuda::Pack<kHalfBytes> b = cuda::load_pack<kHalfBytes>(base + R::second(j) * kEs);
      cuda::Pack<kV * kEs> v;
#pragma unroll
      for (int i = 0; i < kHalfBytes / 4; ++i) v.w[i] = a.w[i], v.w[kHalfBytes / 4 + i] = b.w[i];
      return v;
    }
  }
  return cuda::load_pack<kV * kEs>(base + R::first(j) * kEs);
}

// Stores lane j's kV values (a pack of kV kEs-byte elements) into a row at base: one store, or two.
template <class R, int kEs>
__device__ __forceinline__ void store_lane(char* base, int j, const cuda::Pack<R::kValues * kEs>& v) {
  constexpr int kV = R::kValues, kHalfBytes = kV * kEs / 2;
  if constexpr (R::kSplitLanes) {
    if (R::split(j)) {
      cuda::Pack<kHalfBytes> a, b;
#pragma unroll
      for (int i = 0; i < kHalfBytes / 4; ++i) a.w[i] = v.w[i], b.w[i] = v.w[kHalfBytes / 4 + i];
      cuda::store_pack<kHalfBytes>(base + R::first(j) * kEs, a);
      cuda::store_pack<kHalfBytes>(base + R::second(j) * kEs, b);
      return;
    }
  }
  cuda::store_pack<kV * kEs>(base + R::first(j) * kEs, v);
}

// The group's sum of squares in the fixed order for split lanes (R: LaneRotation with kSplit, kV 8) of a
// head of kD dims: a split lane's two pieces are halves of 8-dim groups j / 2 and h / 8 + j / 2 (their
// other halves in lane j ^ 1), a lane from rotary_dim on holds group j whole. With the rotation covering
// all of a power-of-two D the first fold of the group sums adds exactly a lane's two groups, lanes 2m and
// 2m + 1 then holding fold m; otherwise each group's sum moves to lane (group) first (two shuffles).
template <class R, int kD, int G>
__device__ __forceinline__ float sum_squares_split(const float (&x)[8], int j, unsigned mask) {
  float s[8], t[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = __fmul_rn(x[i], x[i]);
#pragma unroll
  for (int i = 0; i < 8; ++i) t[i] = __fadd_rn(s[i], __shfl_xor_sync(mask, s[i], 1));
  const float a = __fadd_rn(__fadd_rn(t[0], t[2]), __fadd_rn(t[1], t[3]));
  const float b = __fadd_rn(__fadd_rn(t[4], t[6]), __fadd_rn(t[5], t[7]));
  if constexpr (R::kRotLanes * 8 == kD && is_pow2(kD)) {
    return gather_fold<G / 2, 2, G>(__fadd_rn(a, b), mask);  // lanes 2m and 2m + 1 hold fold m
  } else {
    constexpr int kHalfGroups = R::kHalf / 8;
    const float from_a = __shfl_sync(mask, a, (2 * j) % G, G);
    const float from_b = __shfl_sync(mask, b, (2 * (j - kHalfGroups) + 2 * G) % G, G);
    const float whole = __fadd_rn(__fadd_rn(__fadd_rn(s[0], s[4]), __fadd_rn(s[2], s[6])),
                                  __fadd_rn(__fadd_rn(s[1], s[5]), __fadd_rn(s[3], s[7])));
    return gather_fold<G, 1, G>(j < kHalfGroups ? from_a : j < 2 * kHalfGroups ? from_b : whole, mask);
  }
}

// A lane's kV norm weights of dtype kW (float32 or the sources'): loaded by load() before the PDL
// trigger, made float32 by floats() after it (as LoadedIndex); lanes outside the head read nothing and
// get zeros.
template <int kV, SrcDtype kW>
struct NormWeights {
  cuda::Pack<kV * elem_bytes_of<kW>()> w = {};

  template <class R>
  __device__ __forceinline__ void load(const char* weight, int j, bool inside) {
    if (inside) w = load_lane<R, elem_bytes_of<kW>()>(weight, j);
  }

  __device__ __forceinline__ void floats(float (&out)[kV]) const {
#pragma unroll
    for (int i = 0; i < kV; ++i) out[i] = cuda::SrcTraits<kW>::at(w.w, i);
  }
};

// 1 / sqrt(m) with the square root and the reciprocal each correctly rounded: the bits of
// __frcp_rn(__fsqrt_rn(m)) for every float32 m (test_rope.py checks all 2^32), without those functions'
// range checks and branches, which sit on the norm's critical path (docs/performance.md "rope reciprocal
// root"). m is first scaled by 2^126 or 2^-126 into [2^-100, 2^100], where each is its hardware
// approximation refined by one Newton step (the sequences nvcc emits for sqrt.rn and rcp.rn inside their
// fast ranges); scaling m by 4^k scales the rounded root by 2^k and its rounded reciprocal by 2^-k
// exactly, as no result there is subnormal. Selects, not branches: 0 gives inf, inf gives 0, NaN and
// negative m NaN.
__device__ __forceinline__ float rcp_sqrt_rn(float m) {
  const bool small = m < 0x1p-100f, big = m > 0x1p100f;
  const float mm = __fmul_rn(m, small ? 0x1p126f : big ? 0x1p-126f : 1.0f);
  float y, z;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(mm));
  const float s0 = __fmul_rn(mm, y), half_y = __fmul_rn(y, 0.5f);
  const float s = __fmaf_rn(__fmaf_rn(-s0, s0, mm), half_y, s0);
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(z) : "f"(s));
  const float r = __fmul_rn(__fmaf_rn(z, __fmaf_rn(-s, z, 1.0f), z), small ? 0x1p63f : big ? 0x1p-63f : 1.0f);
  return m == 0.0f ? copysignf(__int_as_float(0x7f800000), m) : m == __int_as_float(0x7f800000) ? 0.0f : r;
}

// x = (x * r) * w, r = 1 / sqrt(sum / D + eps): Qwen3's per-head RMSNorm in the fixed order, lane j
// holding its values as R lays them out.
template <class R, int kD, int G, int kV = R::kValues>
__device__ __forceinline__ void rms_norm(float (&x)[kV], const float (&w)[kV], float eps, int j, unsigned mask) {
  float sum;
  if constexpr (R::kSplitLanes) {
    sum = sum_squares_split<R, kD, G>(x, j, mask);
  } else {
    sum = sum_squares<kV, G>(x, mask);
  }
  // sum / D and 1 / sqrt as the reference rounds them: for a power-of-two D the product with 1 / D is
  // that quotient exactly (it saves a division), and rcp_sqrt_rn rounds the root and its reciprocal.
  const float mean = is_pow2(kD) ? __fmul_rn(sum, 1.0f / float(kD)) : __fdiv_rn(sum, float(kD));
  const float r = rcp_sqrt_rn(__fadd_rn(mean, eps));
#pragma unroll
  for (int i = 0; i < kV; ++i) x[i] = __fmul_rn(__fmul_rn(x[i], r), w[i]);
}

// Loads lane j's cos and sin values (lanes outside the rotated dims load nothing).
template <class R, SrcDtype kCsT>
__device__ __forceinline__ void load_cos_sin(const char* row, int j, float (&c)[R::kCs], float (&s)[R::kCs]) {
  if (j < R::kRotLanes) {
    const int i = R::cos_index(j);
    constexpr int es = elem_bytes_of<kCsT>();
    load_floats<kCsT, R::kCs>(row + i * es, c);
    load_floats<kCsT, R::kCs>(row + (R::kHalf + i) * es, s);
  }
}

// RoPE on the lane's values in place: NeoX inside a split lane, or with the partner lane's values (a
// shuffle in the group, every lane of it taking part); GPT-J inside the lane. Lanes from rotary_dim on
// keep theirs.
template <class R, int G, int kV = R::kValues>
__device__ __forceinline__ void rotate(float (&y)[kV], int j, const float (&c)[R::kCs], const float (&s)[R::kCs],
                                       unsigned mask) {
  if constexpr (R::kSplitLanes) {
    if (j < R::kRotLanes) {
#pragma unroll
      for (int i = 0; i < kV / 2; ++i) {
        const float a = y[i], b = y[kV / 2 + i];
        y[i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
        y[kV / 2 + i] = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
      }
    }
  } else if constexpr (R::kIsNeox) {
    const bool first = j < R::kHalfLanes;
    const int partner = first ? j + R::kHalfLanes : j - R::kHalfLanes;
    float other[kV];
#pragma unroll
    for (int i = 0; i < kV; ++i) other[i] = __shfl_sync(mask, y[i], partner, G);
    if (j < R::kRotLanes) {
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const float a = __fmul_rn(y[i], c[i]), b = __fmul_rn(other[i], s[i]);
        y[i] = first ? __fsub_rn(a, b) : __fadd_rn(a, b);
      }
    }
  } else if (j < R::kRotLanes) {
#pragma unroll
    for (int m = 0; m < kV / 2; ++m) {
      const float a = y[2 * m], b = y[2 * m + 1];
      y[2 * m] = __fsub_rn(__fmul_rn(a, c[m]), __fmul_rn(b, s[m]));
      y[2 * m + 1] = __fadd_rn(__fmul_rn(b, c[m]), __fmul_rn(a, s[m]));
    }
  }
}

// kV float32 values rounded to nearest even into kDst (bf16, fp16 or fp32), as kV * size bytes.
template <SrcDtype kDst, int kV>
__device__ __forceinline__ cuda::Pack<kV * elem_bytes_of<kDst>()> round_to(const float (&y)[kV]) {
  cuda::Pack<kV * elem_bytes_of<kDst>()> out;
  if constexpr (kDst == SrcDtype::kF32) {
#pragma unroll
    for (int i = 0; i < kV; ++i) out.w[i] = __float_as_uint(y[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kV / 2; ++i) {
      uint32_t lo, hi;
      if constexpr (kDst == SrcDtype::kBF16) {
        lo = __bfloat16_as_ushort(__float2bfloat16_rn(y[2 * i]));
        hi = __bfloat16_as_ushort(__float2bfloat16_rn(y[2 * i + 1]));
      } else {
        lo = __half_as_ushort(__float2half_rn(y[2 * i]));
        hi = __half_as_ushort(__float2half_rn(y[2 * i + 1]));
      }
      out.w[i] = lo | (hi << 16);
    }
  }
  return out;
}

// kV float32 values as fp8 bytes of kFmt: fp8(div(y)), the quotient correctly rounded (cuda::Divider,
// or cuda::Pow2Divider for a power-of-two scale: cuda::with_divider).
template <KvFormat kFmt, int kV, class Div>
__device__ __forceinline__ cuda::Pack<kV> quantize_floats(const float (&y)[kV], const Div& div) {
  float q[kV];
#pragma unroll
  for (int i = 0; i < kV; ++i) q[i] = div(y[i]);
  cuda::Pack<kV> out;
#pragma unroll
  for (int i = 0; i < kV / 4; ++i) out.w[i] = cuda::fp8x4<kFmt>(q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]);
  return out;
}

// 16 source bytes as fp8 bytes of kFmt (what store_cache and set_mla_kv_buffer write from a source).
template <SrcDtype kSrc, KvFormat kFmt, class Div>
__device__ __forceinline__ cuda::Pack<lane_values<kSrc>()> quantize_source(const cuda::Pack<16>& v, const Div& div) {
  cuda::Pack<lane_values<kSrc>()> out;
  cuda::quantize<kSrc, kFmt, lane_values<kSrc>(), cuda::QuantizeOrder::kValuesThenConvert>(v.w, out.w, div);
  return out;
}

// Stores lane j's float32 values into a row at base of format kFmt, through the lane layout R.
template <SrcDtype kSrc, KvFormat kFmt, class R, int kV, class Div>
__device__ __forceinline__ void store_floats_lane(char* base, int j, const float (&y)[kV], const Div& div) {
  if constexpr (kFmt == KvFormat::kCopy) {
    store_lane<R, elem_bytes_of<kSrc>()>(base, j, round_to<kSrc, kV>(y));
  } else {
    store_lane<R, 1>(base, j, quantize_floats<kFmt, kV>(y, div));
  }
}

// Stores a lane's 16 source bytes into a destination of format kFmt (kCopy: the bytes themselves).
template <SrcDtype kSrc, KvFormat kFmt, class Div>
__device__ __forceinline__ void store_source(char* dst, const cuda::Pack<16>& v, const Div& div) {
  if constexpr (kFmt == KvFormat::kCopy) {
    cuda::store_pack<16>(dst, v);
  } else {
    cuda::store_pack<lane_values<kSrc>()>(dst, quantize_source<kSrc, kFmt>(v, div));
  }
}

// Bytes a lane's values take in a destination of format kFmt.
template <SrcDtype kSrc, KvFormat kFmt>
constexpr int dst_lane_bytes() {
  return kFmt == KvFormat::kCopy ? 16 : lane_values<kSrc>();
}

// A position clamped into [0, max_pos) (docs/design.md §9: CUDA clamps; JITKV_DEBUG=1 raises first).
__device__ __forceinline__ int64_t clamp_position(int64_t p, int64_t max_pos) {
  return p < 0 ? 0 : p >= max_pos ? max_pos - 1 : p;
}

using cuda::load_index;
using cuda::load_index_later;
using cuda::LoadedIndex;

}  // namespace jitkv::rope
