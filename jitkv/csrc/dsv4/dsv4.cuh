// DeepSeek-V4 FP8 K cache: the record layout, the kernels' parameter blocks and the kernels
// (docs/design.md §5); the binding is dsv4_cuda.cu.
//
// Layout: one head of 512 dims per token: dims 0..447 as e4m3 (448 B) + dims 448..511 as bf16 (128 B) =
// 576 B of data, plus 8 B of UE8M0 scales (7 groups of 64 dims, 8th byte 0). A block of block_size tokens
// holds all token data first (token t at t*576), then all scales (token t at block_size*576 + t*8):
// block_size*584 bytes, then any padding up to the block stride (a multiple of 16 bytes). The numbers
// come from jitkv/layouts.py as build arguments (JITKV_DSV4_*); the kernels' lane mapping below is
// written for them, which the static_asserts check.
//
// Writer (quantize_and_insert_k_cache): one warp per token, kWriteTok tokens per warp. Lane l holds dims
// [8l, 8l+8) and [256+8l, 256+8l+8) (two coalesced 16-byte loads), so each 64-dim group lives in 8 lanes
// and its amax needs 3 xor-shuffles (both groups of a lane packed in one word). The UE8M0 exponent comes
// from the float bits of max(amax, 1e-4) (exact, no log2), the scale is a power of two, so x * 2^-e is
// exact and one hardware RN satfinite conversion gives the e4m3 byte torch would give (pre-sm_89
// targets do the same rounding in integer arithmetic). Slots are read first; slot < 0 or past the cache
// skips the token before its row is loaded. The 8 scale bytes go out as one 8-byte store, into a
// 32-byte sector the warp prefetched into L2 as soon as the slot was known (see the writer kernel).
//
// Gather (dequantize_and_gather_k_cache): one warp per token, kGatherTok tokens per warp and
// kGatherWarps warps per CTA, so one CTA covers a tile of consecutive positions of one request. Lane t
// resolves token t (block-table lookup once per token; for whole-sequence gathers it is issued together
// with the seq_lens load) and shuffles its address to the warp; the warp then issues the loads of all
// its tokens before converting any (kGatherTok x 584 B in flight per warp), converts e4m3 -> f16 -> f32,
// multiplies by the exact power-of-two scale and stores 16-byte bf16 vectors. The grid is sized from
// R x out.shape[1] (graph-safe: no read of seq_lens on the host) but capped at 4 waves of resident
// CTAs; CTAs loop over tiles and jump past a request's tiles once they lie beyond its gather length, so
// an out buffer much longer than the gathers costs O(R) per CTA. Below the cap each CTA takes one tile
// and the hardware balances them: with a 1-wave cap, 1 x 32768 tokens (then 2048 tiles over 792
// resident CTAs) ran 3 rounds where 2.6 were needed, 17.3 us against 16.7 us with the 4-wave cap (H200).
//
// Both kernels launch with programmatic dependent launch on SM90+ (jitkv/cuda/launch.cuh).
// Launch constants below, measured on an H200: 1/2/4 tokens per warp were within 3 % of each other at
// the benchmark's gather sizes; 4 and 64 waves gave the same times; 4 warps per CTA at 32 registers
// (16 CTAs per SM) beat 8 warps at 40 registers (6 CTAs per SM) by 1-3 %: 1 x 32768 in 16.5 us
// instead of 16.7 us.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jitkv/cuda/fp8.cuh"
#include "jitkv/cuda/launch.cuh"

#if !defined(JITKV_DSV4_HEAD_DIM) || !defined(JITKV_DSV4_NOPE) || !defined(JITKV_DSV4_GROUP) || \
    !defined(JITKV_DSV4_SCALE_BYTES)
#error "dsv4.cuh needs the record layout: -DJITKV_DSV4_HEAD_DIM, _NOPE, _GROUP, _SCALE_BYTES (jitkv/layouts.py)"
#endif

namespace jitkv::dsv4 {

constexpr int kHeadDim = JITKV_DSV4_HEAD_DIM;
constexpr int kNopeDim = JITKV_DSV4_NOPE;           // dims stored as e4m3
constexpr int kRopeDim = kHeadDim - kNopeDim;       // dims stored as bf16
constexpr int kGroupSize = JITKV_DSV4_GROUP;        // dims per UE8M0 scale
constexpr int kNumGroups = kNopeDim / kGroupSize;   // real scales
constexpr int kNopeBytes = kNopeDim;                // one e4m3 byte per dim
constexpr int kDataBytes = kNopeBytes + 2 * kRopeDim; // e4m3 + bf16
constexpr int kScaleBytes = JITKV_DSV4_SCALE_BYTES; // scales + zero padding
constexpr int kTokenBytes = kDataBytes + kScaleBytes;
static_assert(kHeadDim == 512 && kNopeDim == 448 && kGroupSize == 64 && kScaleBytes == 8,
              "the lane mapping of these kernels is written for the 512-dim record of 448 e4m3 + 64 bf16");

// Bytes from a block's start to its scale region.
constexpr int64_t scale_offset(int64_t block_size) { return block_size * kDataBytes; }

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWriteWarps = 8;
constexpr int kWriteTok = 1;            // tokens per writer warp
constexpr int kGatherWarps = 4;         // warps per gather CTA
constexpr int kGatherTok = 2;           // tokens per gather warp
constexpr int64_t kGatherWaves = 4;     // gather grid cap, in resident-CTA waves
// Registers capped for a full SM (2048 threads, so 32 per thread): more warps, more loads in flight.
constexpr int kGatherMinCtas = 2048 / (kGatherWarps * 32);
constexpr uint32_t kMinAmaxBits = 0x38D1B717u;  // bits of 1e-4f
constexpr uint32_t kNoScaleExp = 128;           // exponent of a group whose amax is inf or NaN
static_assert(kWriteTok <= 32 && kGatherTok <= 32, "one lane resolves each token of a warp");

// ---------------------------------------------------------------------------------------------
// Scalar conversions.

// e = smallest integer with 448 * 2^e >= m, m = max(amax, 1e-4) given as bf16 magnitude bits. With
// m = 1.f * 2^(E-127) (float bits E, f), 448 = 1.75 * 2^8 gives e = E - 135 + (1.f > 1.75). Finite bf16
// amax keeps e in [-22, 120]; inf or NaN gives 128 (byte 255, the UE8M0 NaN code).
__device__ __forceinline__ uint32_t ue8m0_exponent_biased(uint32_t amax16) {
  const uint32_t m = max(amax16 << 16, kMinAmaxBits);  // integer max == float max here, NaN largest
  const uint32_t be = m >> 23;
  if (be == 255) return kNoScaleExp + 127;
  return be - 8 + ((m & 0x7FFFFFu) > 0x600000u);      // (E - 135 + carry) + 127
}

// 2^-e as a float for the biased exponent b = e + 127 (2^-128 is a float denormal).
__device__ __forceinline__ float inv_pow2(uint32_t b) {
  return __uint_as_float(b == 255 ? 0x00200000u : (254u - b) << 23);
}

// 2^(b - 127) as a float; b = 0 is the denormal 2^-127, b = 255 gives inf.
__device__ __forceinline__ float ue8m0_scale(uint32_t b) {
  return __uint_as_float(b ? b << 23 : 0x00400000u);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
// Pre-Ada: no fp8 conversion instructions; same rounding in integer arithmetic.
__device__ __forceinline__ uint32_t e4m3_encode(float y) {  // RNE, saturating to 448; NaN -> 0x7E
  const uint32_t b = __float_as_uint(y);
  const uint32_t a = min(b & 0x7FFFFFFFu, 0x43E00000u);
  uint32_t r;
  if (a >= 0x3C800000u) {  // normal e4m3: keep 3 mantissa bits, rebias 127 -> 7
    r = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960u;
  } else {                 // denormal e4m3: round |y| * 2^9 to an integer
    const uint32_t ea = a >> 23;
    const uint32_t m = (a & 0x7FFFFFu) | (ea ? 0x800000u : 0u);
    const uint32_t s = min(141u - max(ea, 1u), 31u);
    r = (m + (1u << (s - 1)) - 1u + ((m >> s) & 1u)) >> s;
  }
  return r | ((b >> 24) & 0x80u);
}

__device__ __forceinline__ uint32_t e4m3x2(float hi, float lo) {
  return (e4m3_encode(hi) << 8) | e4m3_encode(lo);
}

#else
// Two floats -> two e4m3 bytes (hi in bits 8..15): round to nearest even, finite values past 448 and
// infinities saturate to +-448 (equal to clamp then round).
__device__ __forceinline__ uint32_t e4m3x2(float hi, float lo) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif

// ---------------------------------------------------------------------------------------------
// Memory access. The cache and the source rows are read once: skip L1. A false predicate loads no
// memory and yields zeros (zero rows of the gather, skipped tokens of the writer).

__device__ __forceinline__ uint2 ld_v2(const void* p, bool pred) {
  uint2 v;
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %3, 0; mov.b32 %0, 0; mov.b32 %1, 0;\n"
      "@p ld.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];}"
      : "=r"(v.x), "=r"(v.y) : "l"(p), "r"(int(pred)));
  return v;
}

__device__ __forceinline__ uint4 ld_v4(const void* p, bool pred) {
  uint4 v;
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %5, 0; mov.b32 %0, 0; mov.b32 %1, 0; mov.b32 %2, 0; mov.b32 %3, 0;\n"
      "@p ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];}"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "r"(int(pred)));
  return v;
}

__device__ __forceinline__ int32_t ld_s32(const int32_t* p, bool pred, int32_t fallback) {
  int32_t v;
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %2, 0; mov.b32 %0, %3;\n"
      "@p ld.global.s32 %0, [%1];}"
      : "=r"(v) : "l"(p), "r"(int(pred)), "r"(fallback));
  return v;
}

__device__ __forceinline__ int64_t shfl64(int64_t v, int src) {
  const int lo = __shfl_sync(kFull, static_cast<int>(v), src);
  const int hi = __shfl_sync(kFull, static_cast<int>(v >> 32), src);
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(hi)) << 32) |
                              static_cast<uint32_t>(lo));
}

// ---------------------------------------------------------------------------------------------
// Writer.

struct WriteParams {
  const uint16_t* k;      // bf16 bits
  int64_t k_stride;       // elements between rows of k
  uint8_t* cache;
  int64_t block_stride;   // bytes
  int64_t num_slots;      // num_blocks * block_size
  const void* slots;
  int64_t n;
  int64_t block_size;
};

// Max |x| over 8 bf16 as magnitude bits (integer max: NaN > inf > finite, so NaN propagates).
__device__ __forceinline__ uint32_t absmax8(uint4 v) {
  constexpr uint32_t kMag = 0x7FFF7FFFu;
  const uint32_t m = __vmaxu2(__vmaxu2(v.x & kMag, v.y & kMag), __vmaxu2(v.z & kMag, v.w & kMag));
  return max(m & 0xFFFFu, m >> 16);
}

// e4m3 of two bf16 (one word) times 2^-e.
__device__ __forceinline__ uint32_t quant2(uint32_t w, float inv) {
  return e4m3x2(__uint_as_float(w & 0xFFFF0000u) * inv, __uint_as_float(w << 16) * inv);
}

// e4m3 NaN keeps the sign of the bf16 NaN (as torch's conversion does); the scaled product may not.
__device__ __noinline__ uint2 fix_nan8(uint4 x, uint2 q) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[2] = {q.x, q.y};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t h = (w[j / 2] >> (16 * (j % 2))) & 0xFFFFu;
    if ((h & 0x7FFFu) > 0x7F80u) {
      const int sh = 8 * (j % 4);
      out[j / 4] = (out[j / 4] & ~(0xFFu << sh)) | ((0x7Fu | ((h >> 8) & 0x80u)) << sh);
    }
  }
  return make_uint2(out[0], out[1]);
}

// 8 bf16 -> 8 e4m3 bytes with the group's biased exponent b.
__device__ __forceinline__ uint2 quant8(uint4 x, uint32_t b, bool has_nan) {
  const float inv = inv_pow2(b);
  uint2 q = make_uint2(quant2(x.x, inv) | (quant2(x.y, inv) << 16),
                       quant2(x.z, inv) | (quant2(x.w, inv) << 16));
  if (has_nan) q = fix_nan8(x, q);
  return q;
}

// One token: xa = dims [8l, 8l+8), xb = dims [256+8l, 256+8l+8) of lane l.
__device__ __forceinline__ void quantize_token(uint4 xa, uint4 xb, uint8_t* dst, uint8_t* dst_scale,
                                               int lane) {
  uint32_t amax = absmax8(xa) | (absmax8(xb) << 16);  // groups lane/8 and 4 + lane/8 (or rope)
#pragma unroll
  for (int s = 1; s < 8; s <<= 1) amax = __vmaxu2(amax, __shfl_xor_sync(kFull, amax, s));
  const uint32_t amax_a = amax & 0xFFFFu, amax_b = amax >> 16;
  const uint32_t ba = ue8m0_exponent_biased(amax_a), bb = ue8m0_exponent_biased(amax_b);

  *reinterpret_cast<uint2*>(dst + 8 * lane) = quant8(xa, ba, amax_a > 0x7F80u);
  if (lane < 24) {
    *reinterpret_cast<uint2*>(dst + 256 + 8 * lane) = quant8(xb, bb, amax_b > 0x7F80u);
  } else {  // dims 448..511: bf16 bytes as they are
    *reinterpret_cast<uint4*>(dst + kNopeBytes + 16 * (lane - 24)) = xb;
  }
  // The 8 scale bytes as one store (one partial-sector write, not two): group g's byte sits in lane 8g.
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    lo |= __shfl_sync(kFull, ba, 8 * g) << (8 * g);
    if (g < 3) hi |= __shfl_sync(kFull, bb, 8 * g) << (8 * g);  // byte 7 stays 0
  }
  if (lane == 0) *reinterpret_cast<uint2*>(dst_scale) = make_uint2(lo, hi);
}

template <typename IdxT>
__global__ void __launch_bounds__(kWriteWarps * 32) dsv4_quant_insert_kernel(const __grid_constant__ WriteParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * kWriteTok;
  // Addresses first (they read only the parameter block), pinned ahead of warm_params' branch: else the
  // compiler computes them after the wait, between the wait and the loads.
  const bool has_slot = lane < kWriteTok && first + lane < p.n;
  const IdxT* slot_at = static_cast<const IdxT*>(p.slots) + first + lane;
  const uint16_t* src[kWriteTok];
#pragma unroll
  for (int t = 0; t < kWriteTok; ++t) {
    src[t] = p.k + (first + t) * p.k_stride + 8 * lane;
    asm volatile("" : "+l"(src[t]));
  }
  asm volatile("" : "+l"(slot_at));
  jitkv::cuda::warm_params(p, p.n);
  jitkv::cuda::pdl_wait();  // k and the slots may come from the previous kernel

  // Lane t < kWriteTok loads the slot of token first + t (-1: skip the token). The rows of every
  // token < n are loaded at the same time (padding rows' sources exist; they are never written): one
  // memory round trip from the PDL wait to the first conversion.
  int64_t slot = -1;
  if (has_slot) {
    const int64_t s = static_cast<int64_t>(cuda::load(slot_at));
    if (s >= 0 && s < p.num_slots) slot = s;
  }
  uint4 xa[kWriteTok], xb[kWriteTok];
#pragma unroll
  for (int t = 0; t < kWriteTok; ++t) {  // all rows in flight before the first conversion
    const bool real = first + t < p.n;
    xa[t] = ld_v4(src[t], real);
    xb[t] = ld_v4(src[t] + 256, real);
  }
  jitkv::cuda::pdl_launch_dependents();  // after the loads (see set_mla_kv_buffer.cuh)
  // Block and row (a 64-bit division) while the rows are in flight, not before their loads.
  int64_t base = -1;
  int row = 0;
  if (slot >= 0) {
    const int64_t blk = slot / p.block_size;
    base = blk * p.block_stride;
    row = static_cast<int>(slot - blk * p.block_size);
    // The 8-byte scale write is a partial 32-byte sector: with the sector already in L2 it is
    // written back whole, instead of as a masked write the memory controller must merge
    // (read-modify-write in DRAM). H200, 65,536 random token slots: 34.6 us with the prefetch, 38.5
    // without (python -m jitkv.benchmark --op dsv4).
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p.cache + base + scale_offset(p.block_size) + row * kScaleBytes));
  }
#pragma unroll
  for (int t = 0; t < kWriteTok; ++t) {
    const int64_t bt = shfl64(base, t);
    const int rt = __shfl_sync(kFull, row, t);
    if (bt < 0) continue;
    uint8_t* blk = p.cache + bt;
    quantize_token(xa[t], xb[t], blk + int64_t(rt) * kDataBytes, blk + scale_offset(p.block_size) + rt * kScaleBytes,
                   lane);
  }
}

// ---------------------------------------------------------------------------------------------
// Gather.

struct GatherParams {
  uint16_t* out;          // bf16 bits
  int64_t out_s0, out_s1; // elements
  int64_t rows;           // out.shape[1] - offset: rows each request may fill
  int64_t offset;
  const uint8_t* cache;
  int64_t block_stride;   // bytes
  int64_t num_blocks;
  const int32_t* seq_lens;
  const int32_t* gather_lens;  // null: gather whole sequences
  const int32_t* block_table;
  int64_t bt_stride;
  int64_t max_blocks;
  int32_t block_size;
  int64_t tiles_per_req;
  int64_t num_tiles;
};

// Block-table entry of position pos of request r, or -1 when pred is false or the position lies past
// the table. Issued as a load that the caller need not wait for yet.
__device__ __forceinline__ int32_t lookup_block(const GatherParams& p, int64_t r, int64_t pos,
                                                bool pred) {
  pred = pred && pos >= 0 && pos <= INT32_MAX;
  const uint32_t blk = pred ? static_cast<uint32_t>(pos) / static_cast<uint32_t>(p.block_size) : 0u;
  return ld_s32(p.block_table + r * p.bt_stride + blk, pred && blk < p.max_blocks, -1);
}

// One tile: tokens i = first + t * kGatherWarps (t < kGatherTok) of request r for this warp, at
// positions start + i; rows i >= limit are not written. Lane t resolves token t; phys is its
// block-table entry if have_phys (whole-sequence gathers look it up early).
__device__ __forceinline__ void gather_tokens(const GatherParams& p, int64_t r, int64_t first,
                                              int64_t start, int64_t limit, int32_t phys,
                                              bool have_phys, int lane) {
  const int64_t i = first + lane * kGatherWarps;
  const bool write = lane < kGatherTok && i < limit;
  const int64_t pos = start + i;  // < seq_len <= INT32_MAX when written
  if (!have_phys) phys = lookup_block(p, r, pos, write);
  int64_t base = -1;  // byte offset of the token's block; -1: zero row
  int row = 0;
  if (write && phys >= 0 && phys < p.num_blocks) {
    base = phys * p.block_stride;
    row = static_cast<int>(static_cast<uint32_t>(pos) % static_cast<uint32_t>(p.block_size));
  }
  const uint32_t write_mask = __ballot_sync(kFull, write);
  if (write_mask == 0) return;

  uint2 a[kGatherTok], sc[kGatherTok];
  uint4 b[kGatherTok];
#pragma unroll
  for (int t = 0; t < kGatherTok; ++t) {  // every load of the warp in flight before the first use
    const int64_t bt = shfl64(base, t);
    const int rt = __shfl_sync(kFull, row, t);
    const bool ld = bt >= 0;
    const uint8_t* blk = p.cache + (ld ? bt : 0);
    const uint8_t* data = blk + int64_t(rt) * kDataBytes;
    a[t] = ld_v2(data + 8 * lane, ld);
    const uint2 nope = ld_v2(data + 256 + 8 * lane, ld && lane < 24);
    b[t] = ld_v4(data + kNopeBytes + 16 * (lane - 24), ld && lane >= 24);
    if (lane < 24) b[t] = make_uint4(nope.x, nope.y, 0u, 0u);
    sc[t] = ld_v2(blk + scale_offset(p.block_size) + rt * kScaleBytes, ld);
  }
  const int g = lane >> 3;
#pragma unroll
  for (int t = 0; t < kGatherTok; ++t) {
    if (!((write_mask >> t) & 1u)) continue;
    const int64_t it = first + t * kGatherWarps;
    uint16_t* orow = p.out + r * p.out_s0 + (p.offset + it) * p.out_s1;
    // e4m3 times a power of two: exact unless the scale leaves the bf16 range
    const uint4 oa = cuda::dequant8<false>(a[t].x, a[t].y, ue8m0_scale((sc[t].x >> (8 * g)) & 0xFFu));
    const uint4 ob = lane < 24 ? cuda::dequant8<false>(b[t].x, b[t].y, ue8m0_scale((sc[t].y >> (8 * g)) & 0xFFu))
                               : b[t];
    *reinterpret_cast<uint4*>(orow + 8 * lane) = oa;  // plain stores: the attention kernel reads
    *reinterpret_cast<uint4*>(orow + 256 + 8 * lane) = ob;  // these rows next, from L2 if they stay
  }
}

__global__ void __launch_bounds__(kGatherWarps * 32, kGatherMinCtas) dsv4_gather_kernel(const __grid_constant__ GatherParams p) {
  jitkv::cuda::warm_params(p, p.rows);
  jitkv::cuda::pdl_wait();  // the cache, seq_lens and block table may come from the previous kernel
  jitkv::cuda::pdl_launch_dependents();
  constexpr int kTile = kGatherWarps * kGatherTok;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool whole = p.gather_lens == nullptr;
  const int64_t grid = gridDim.x;
  int64_t tile = blockIdx.x;
  while (tile < p.num_tiles) {
    const int64_t r = tile / p.tiles_per_req;
    const int64_t i0 = (tile - r * p.tiles_per_req) * kTile;
    const int64_t first = i0 + warp;
    // A whole-sequence gather has position == row index: its block-table lookup goes out together
    // with the seq_lens load instead of after it (one memory latency less per tile).
    const int32_t phys = whole ? lookup_block(p, r, first + lane * kGatherWarps,
                                              lane < kGatherTok && first + lane * kGatherWarps < p.rows)
                               : -1;
    const int64_t seq = ld_s32(p.seq_lens + r, true, 0);
    const int64_t gl = whole ? seq : ld_s32(p.gather_lens + r, true, 0);
    const int64_t limit = min(gl, p.rows);
    if (i0 >= limit) {  // this and later tiles of r are empty: first tile of r + 1 that is ours
      const int64_t next = (r + 1) * p.tiles_per_req;
      tile = next + ((static_cast<int64_t>(blockIdx.x) - next) % grid + grid) % grid;
      continue;
    }
    gather_tokens(p, r, first, seq - gl, limit, phys, whole, lane);
    tile += grid;
  }
}

}  // namespace jitkv::dsv4
