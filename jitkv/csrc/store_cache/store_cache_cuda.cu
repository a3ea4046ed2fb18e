// tvm-ffi binding of store_cache on CUDA: parses and checks the arguments (parse.h), checks them
// against this module's template arguments, picks the vector width, the kernel and the launch shape,
// and launches on the caller's current stream (jitkv/cuda/launch.cuh: PDL from sm_90, device guard).
//
// Template arguments (JitSpec args; the Python side builds one module per distinct tuple):
//   JITKV_K_HEAD_BYTES, JITKV_V_HEAD_BYTES  cache bytes per K / V head (head_dim * cache element size),
//       multiples of 16, for caches and sources whose base addresses and strides are 16-byte aligned;
//       0 and 0 select the any-alignment ("generic") build: any head size and alignment, vector width
//       picked per call (16, 8, 4, 2 or 1 bytes). Python picks the build from the head bytes
//       (ops/store_cache.py, _cuda_variant); a 16-byte build given a less aligned view returns
//       kNeedsAnyAlignment before launching, and the op dispatches the any-alignment build.
//   JITKV_SRC_DTYPE  a codes::SrcDtype: none for a plain byte copy (kv_cache_dtype "auto", any dtype);
//       bf16, fp16 or fp32 (sources quantized to fp8).
//   JITKV_KV_DTYPE   the cache format, a codes::KvFormat: copy, e4m3 or e5m2.
//   JITKV_PDL        0 launches without programmatic dependent launch (tests).
//   JITKV_PAGE_TABLE 1: the slots come from FlashInfer's page table, walked in the kernels (jitkv/page_table.h;
//       TableStoreCacheArgs, RowTable); such a build exports store_cache_table only, copies only.
// Launch shape: one warp per (token, chunk[, side]); the latency kernel in blocks of 4 or 8 warps
// (jitkv/cuda/launch.cuh latency_warps_per_block), the bulk kernel in blocks of 1, 2, 4 or 8 warps so
// that its grid spreads over the SMs first. Each build holds two kernels (kernels.cuh): the latency
// kernel while its warps per token side fit in kLatencyWarpsPerSM per SM, the bulk kernel beyond; a
// 16-byte build also holds the row kernels (row.cuh), the latency kernel's form for the calls
// use_row_kernel takes.
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "jitkv/codes.h"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/paged.cuh"
#include "store_cache/kernels.cuh"
#include "store_cache/params.h"
#include "store_cache/parse.h"
#include "store_cache/row.cuh"

namespace {

using namespace jitkv::store_cache;
using jitkv::codes::Status;
using jitkv::cuda::DeviceInfo;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;

constexpr const char* kOp = "store_cache";
constexpr int kKHeadBytes = JITKV_K_HEAD_BYTES;
constexpr int kVHeadBytes = JITKV_V_HEAD_BYTES;
constexpr SrcDtype kSrc = static_cast<SrcDtype>(JITKV_SRC_DTYPE);
constexpr KvFormat kFmt = static_cast<KvFormat>(JITKV_KV_DTYPE);
constexpr bool kGeneric = kKHeadBytes == 0;
constexpr bool kPdl = JITKV_PDL != 0;
constexpr bool kTable = JITKV_PAGE_TABLE != 0;
constexpr int kRatio = src_ratio(kSrc, kFmt);
static_assert((kKHeadBytes == 0) == (kVHeadBytes == 0), "K and V are both specialised or both generic");
static_assert(kKHeadBytes % 16 == 0 && kVHeadBytes % 16 == 0, "specialised head bytes must be multiples of 16");
static_assert(kFmt == KvFormat::kCopy || kFmt == KvFormat::kE4M3 || kFmt == KvFormat::kE5M2,
              "JITKV_KV_DTYPE: codes::KvFormat copy, e4m3 or e5m2");
static_assert(!kTable || (kFmt == KvFormat::kCopy && !kGeneric), "page-table builds: 16-byte copies");

// Latency kernels while n x chunks (x 2 sides for fp8) stays within this many warps per SM, the bulk
// kernel beyond: the crossovers measured for copies and for fp8 (docs/performance.md
// "kLatencyWarpsPerSM").
constexpr int64_t kLatencyWarpsPerSM = kFmt == KvFormat::kCopy ? 64 : 256;

// Destination bytes per lane of the row kernels: 16 for copies; fp8 builds convert 8 values per lane
// (twice the warps, half of each warp's conversion chain), faster than 16 or 4 (docs/performance.md
// "kRowVec").
constexpr int kRowVec = kFmt == KvFormat::kCopy ? 16 : 8;

SrcDtype src_type_of(DLDataType d) {
  if (d.code == kDLBfloat) return SrcDtype::kBF16;
  if (d.code == kDLFloat && d.bits == 16) return SrcDtype::kF16;
  return SrcDtype::kF32;
}

// Largest power of two <= 16 dividing every value (0 divides into anything).
int64_t common_alignment(std::initializer_list<int64_t> values) {
  uint64_t bits = 16;
  for (int64_t v : values) bits |= static_cast<uint64_t>(v);
  return static_cast<int64_t>(bits & (~bits + 1));
}

// Alignment of one side's cache and source. Strides of size-1 dims never enter an address, so they do
// not count.
int64_t dst_alignment(const Side& s, int64_t heads, int64_t head_bytes) {
  const bool one_block = s.num_slots <= s.block_size;
  return common_alignment({reinterpret_cast<int64_t>(s.dst), head_bytes, one_block ? 0 : s.dst_stride_block,
                           s.block_size == 1 ? 0 : s.dst_stride_token, heads == 1 ? 0 : s.dst_stride_head});
}

int64_t src_alignment(const Side& s, int64_t n, int64_t heads) {
  return common_alignment(
      {reinterpret_cast<int64_t>(s.src), n == 1 ? 0 : s.src_stride_token, heads == 1 ? 0 : s.src_stride_head});
}

// Destination vector width: every cache address is a multiple of it, every source address a multiple
// of the bytes one source load covers (min(16, vec * ratio)).
int pick_vec(const StoreCacheParams& p, int64_t k_head_bytes, int64_t v_head_bytes) {
  int64_t vec = std::min(dst_alignment(p.k, p.num_heads, k_head_bytes), dst_alignment(p.v, p.num_heads, v_head_bytes));
  const int64_t src = std::min(src_alignment(p.k, p.n, p.num_heads), src_alignment(p.v, p.n, p.num_heads));
  while (vec > 1 && std::min<int64_t>(16, vec * kRatio) > src) vec /= 2;
  return static_cast<int>(vec);
}

// The call against this module's template arguments and the kernels' limits.
void check_module(const StoreCacheParams& p, int64_t k_head_bytes, int64_t v_head_bytes, int vec) {
  if (p.device.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << kOp << ": k_cache: expected a CUDA tensor, got " << jitkv::device_str(p.device);
  }
  if (p.kv_dtype != kFmt) {
    TVM_FFI_THROW(ValueError) << kOp << ": kv_cache_dtype: this module was built for JITKV_KV_DTYPE=" << JITKV_KV_DTYPE
                              << ", got " << static_cast<int>(p.kv_dtype);
  }
  if (kFmt != KvFormat::kCopy && src_type_of(p.src_dtype) != kSrc) {
    TVM_FFI_THROW(ValueError) << kOp << ": k: this module was built for JITKV_SRC_DTYPE=" << JITKV_SRC_DTYPE
                              << ", got dtype " << p.src_dtype;
  }
  if (!kGeneric && (k_head_bytes != kKHeadBytes || v_head_bytes != kVHeadBytes)) {
    TVM_FFI_THROW(ValueError) << kOp << ": k_cache: this module was built for " << kKHeadBytes << "/" << kVHeadBytes
                              << " cache bytes per K/V head, got " << k_head_bytes << "/" << v_head_bytes;
  }
  const int64_t row_vecs = p.num_heads * std::max(k_head_bytes, v_head_bytes) / vec;
  if ((row_vecs + 31) / 32 > 65535) {  // grid.y = chunks of at least 32 vectors
    TVM_FFI_THROW(ValueError) << kOp << ": k: rows of " << p.num_heads << " x " << p.k_head_dim
                              << " elements are too large for the CUDA kernel";
  }
  for (const Side* s : {&p.k, &p.v}) {
    if (!jitkv::cuda::block_division_exact(s->block_size, s->num_slots)) {
      TVM_FFI_THROW(ValueError) << kOp << ": k_cache: a block_size that is not a power of two (" << s->block_size
                                << ") needs fewer than 2^32 slots, got " << s->num_slots;
    }
  }
}

// The fields of a side only the CUDA kernels read: vectors of `vec` bytes per head and row, the block
// division (jitkv/cuda/paged.cuh).
void set_kernel_fields(Side& s, int64_t heads, int64_t head_bytes, int vec) {
  s.head_vecs = static_cast<int32_t>(head_bytes / vec);
  s.row_vecs = static_cast<int32_t>(heads * head_bytes / vec);
  const jitkv::cuda::BlockDivision d = jitkv::cuda::block_division(s.block_size);
  s.block_magic = d.magic;
  s.block_shift = d.shift;
}

// Warps per token: chunks of 32 * unroll destination vectors over the longer of the K and V rows.
int64_t chunks_per_token(const StoreCacheParams& p, bool bulk) {
  const int64_t chunk = 32 * chunk_unroll(kSrc, kFmt, bulk);
  return (std::max(p.k.row_vecs, p.v.row_vecs) + chunk - 1) / chunk;
}

using Args = ArgsOf<kTable>;  // the latency and bulk kernels' block
using Kernel = void (*)(Args);

// The kernel for kVec-byte vectors: fp8 builds also hold kernels that divide each head by its own scale.
template <int kVec, bool kBulk>
Kernel kernel(bool per_head) {
  if constexpr (kFmt != KvFormat::kCopy) {
    if (per_head) return store_cache_kernel<kKHeadBytes, kVHeadBytes, kVec, kSrc, kFmt, kBulk, true, kTable>;
  }
  return store_cache_kernel<kKHeadBytes, kVHeadBytes, kVec, kSrc, kFmt, kBulk, false, kTable>;
}

// Heads of one side back to back in its source and its cache rows (or a single head).
bool dense_rows(const StoreCacheParams& p, const Side& s, int64_t head_bytes) {
  return p.num_heads == 1 || (s.src_stride_head == head_bytes * kRatio && s.dst_stride_head == head_bytes);
}

// A side's row stride in a row kernel: with one slot per block (flat caches, and paged ones of
// block_size 1, whose size-1 token dim may have any stride) it is the block stride.
int64_t row_stride(const Side& s) { return s.block_size == 1 ? s.dst_stride_block : s.dst_stride_token; }

// Whether RowArgs holds the call: counts below 2^31, strides in 16-byte units (sources below 1 MiB),
// no skip_slot inside [0, num_slots) (the kernel skips only the slots outside it).
bool fits_row_args(const StoreCacheParams& p) {
  using jitkv::cuda::fits_units;
  return p.n <= INT32_MAX && p.k.num_slots <= INT32_MAX && p.num_heads <= INT32_MAX &&
         (p.skip_slot < 0 || p.skip_slot >= p.k.num_slots) && fits_units(p.k.src_stride_token, 16, UINT16_MAX) &&
         fits_units(p.v.src_stride_token, 16, UINT16_MAX) && fits_units(row_stride(p.k), 16, UINT32_MAX) &&
         fits_units(row_stride(p.v), 16, UINT32_MAX);
}

// Whether RowFp8Args holds the call (beyond fits_row_args): K and V with one source and one cache row
// stride, V's pointers within 2^31 16-byte units of K's, fewer than 2^16 heads.
bool fits_row_fp8_args(const StoreCacheParams& p) {
  const auto fits_offset = [](const void* k, const void* v) {
    const int64_t d = reinterpret_cast<int64_t>(v) - reinterpret_cast<int64_t>(k);
    return d % 16 == 0 && d / 16 >= INT32_MIN && d / 16 <= INT32_MAX;
  };
  return p.k.src_stride_token == p.v.src_stride_token && row_stride(p.k) == row_stride(p.v) &&
         p.num_heads <= UINT16_MAX && fits_offset(p.k.src, p.v.src) && fits_offset(p.k.dst, p.v.dst);
}

// The latency calls a row kernel takes in a 16-byte build (row.cuh): no loc_map, one scale per side or
// contiguous per-head scales, dense rows, one block size for K and V; the row kernel is faster than the
// latency kernel there, and its 32/16-bit block than one with 64-bit strides and skip_slot
// (docs/performance.md "use_row_kernel", "RowArgs"). fp8 builds take RowFp8Args (row.cuh).
bool use_row_kernel(const StoreCacheParams& p, int64_t k_head_bytes, int64_t v_head_bytes) {
  return p.loc_map == nullptr && p.k.scale_stride <= 1 && p.v.scale_stride <= 1 && p.same_blocks &&
         dense_rows(p, p.k, k_head_bytes) && dense_rows(p, p.v, v_head_bytes) && fits_row_args(p) &&
         (kFmt == KvFormat::kCopy || fits_row_fp8_args(p));
}

// One scale of RowFp8Args: the pointer (| 2 for per-head scales), or the value's bits << 32 | 1.
uint64_t scale_word(const Side& s) {
  if (s.scale_ptr != nullptr) return reinterpret_cast<uint64_t>(s.scale_ptr) | (s.scale_stride ? 2u : 0u);
  uint32_t bits;
  std::memcpy(&bits, &s.scale, 4);
  return (uint64_t{bits} << 32) | 1u;
}

// V's pointer as an offset from K's in 16-byte units (fits_row_fp8_args checked it).
int32_t offset16(const void* k, const void* v) {
  return static_cast<int32_t>((reinterpret_cast<int64_t>(v) - reinterpret_cast<int64_t>(k)) / 16);
}

RowArgs copy_row_args(const StoreCacheParams& p) {
  RowArgs a{};
  a.src[0] = p.k.src;
  a.src[1] = p.v.src;
  a.dst[0] = p.k.dst;
  a.dst[1] = p.v.dst;
  a.slots = p.slots;
  a.n = static_cast<int32_t>(p.n);
  a.num_slots = static_cast<int32_t>(p.k.num_slots);
  a.dst_stride16[0] = static_cast<uint32_t>(row_stride(p.k) / 16);
  a.dst_stride16[1] = static_cast<uint32_t>(row_stride(p.v) / 16);
  a.src_stride16[0] = static_cast<uint16_t>(p.k.src_stride_token / 16);
  a.src_stride16[1] = static_cast<uint16_t>(p.v.src_stride_token / 16);
  a.heads = static_cast<int32_t>(p.num_heads);
  return a;
}

RowFp8Args fp8_row_args(const StoreCacheParams& p) {
  RowFp8Args a{};
  a.src = p.k.src;
  a.dst = p.k.dst;
  a.slots = p.slots;
  a.v_src16 = offset16(p.k.src, p.v.src);
  a.v_dst16 = offset16(p.k.dst, p.v.dst);
  a.n = static_cast<int32_t>(p.n);
  a.num_slots = static_cast<int32_t>(p.k.num_slots);
  a.dst_stride16 = static_cast<uint32_t>(row_stride(p.k) / 16);
  a.src_stride16 = static_cast<uint16_t>(p.k.src_stride_token / 16);
  a.heads = static_cast<uint16_t>(p.num_heads);
  a.scale[0] = scale_word(p.k);
  a.scale[1] = scale_word(p.v);
  return a;
}

// A row kernel's parameter block from the call's, and its launch.
template <bool kPaged, typename TSlot>
cudaError_t launch_row(const StoreCacheParams& p, const jitkv::PageTable& table, dim3 grid, dim3 block,
                       cudaStream_t stream, bool pdl) {
  RowArgsOf<kPaged, kFmt != KvFormat::kCopy, kTable> a{};
  if constexpr (kFmt != KvFormat::kCopy) {
    static_cast<RowFp8Args&>(a) = fp8_row_args(p);
  } else {
    static_cast<RowArgs&>(a) = copy_row_args(p);
  }
  if constexpr (kPaged) {
    a.k_block_adj = block_adj(p.k);
    a.v_block_adj = block_adj(p.v);
    a.block_magic = p.k.block_magic;
    a.block_shift = p.k.block_shift;
  }
  jitkv::cuda::set_page_table<kTable>(a, table);
  return jitkv::cuda::launch(
      store_cache_row_kernel<kKHeadBytes, kVHeadBytes, kRowVec, kSrc, kFmt, kPaged, TSlot, kTable>, grid, block, stream,
      pdl, a);
}

// Launches the latency kernel (its row form where the call fits) while its warps fit in
// kLatencyWarpsPerSM per SM, the bulk kernel beyond, with kVec-byte destination vectors.
template <int kVec>
cudaError_t launch(const StoreCacheParams& p, const jitkv::PageTable& table, int64_t k_head_bytes, int64_t v_head_bytes,
                   const DeviceInfo& info, cudaStream_t stream) {
  const bool bulk = p.n * chunks_per_token(p, false) > kLatencyWarpsPerSM * info.sms;
  const unsigned sides = split_sides(kFmt, kKHeadBytes, kVHeadBytes, bulk) ? 2u : 1u;
  const bool pdl = kPdl && info.pdl();
  if constexpr (!kGeneric) {
    if (!bulk && use_row_kernel(p, k_head_bytes, v_head_bytes)) {
      const int64_t chunks = (p.num_heads * std::max(k_head_bytes, v_head_bytes) / kRowVec + 31) / 32;
      const int wpb = jitkv::cuda::latency_warps_per_block(p.n * chunks * sides, info.sms);
      const dim3 grid(static_cast<unsigned>((p.n + wpb - 1) / wpb), static_cast<unsigned>(chunks), sides);
      const dim3 block(32 * wpb);
      // A page-table build reads no slot_mapping: its row kernels are the int64 instances only.
      if (p.k.block_size > 1) {
        return p.slot_i64 || kTable ? launch_row<true, int64_t>(p, table, grid, block, stream, pdl)
                                    : launch_row<true, int32_t>(p, table, grid, block, stream, pdl);
      }
      return p.slot_i64 || kTable ? launch_row<false, int64_t>(p, table, grid, block, stream, pdl)
                                  : launch_row<false, int32_t>(p, table, grid, block, stream, pdl);
    }
  }
  const bool per_head = p.k.scale_stride != 0 || p.v.scale_stride != 0;
  const int64_t chunks = chunks_per_token(p, bulk);
  const int wpb = bulk ? jitkv::cuda::spread_warps_per_block(p.n * chunks, info.sms, kMaxWarpsPerBlock)
                       : jitkv::cuda::latency_warps_per_block(p.n * chunks * sides, info.sms);
  const dim3 grid(static_cast<unsigned>((p.n + wpb - 1) / wpb), static_cast<unsigned>(chunks), sides);
  Args a{};
  static_cast<StoreCacheArgs&>(a) = p;
  jitkv::cuda::set_page_table<kTable>(a, table);
  return jitkv::cuda::launch(bulk ? kernel<kVec, true>(per_head) : kernel<kVec, false>(per_head), grid, dim3(32 * wpb),
                             stream, pdl, a);
}

// The parsed call's launch (table: a page-table build's, else unused): kNeedsAnyAlignment when this
// 16-byte build cannot address the view (an address or a used stride of k/v/k_cache/v_cache that is not
// a multiple of 16 bytes), else kDone after the launch.
int64_t run(StoreCacheParams& p, const jitkv::PageTable& table) {
  const int64_t cache_elem = p.kv_dtype == KvFormat::kCopy ? jitkv::elem_bytes(p.src_dtype) : 1;
  const int64_t k_head_bytes = p.k_head_dim * cache_elem, v_head_bytes = p.v_head_dim * cache_elem;
  const int vec = pick_vec(p, k_head_bytes, v_head_bytes);
  check_module(p, k_head_bytes, v_head_bytes, vec);
  if (!kGeneric && vec != 16) return status(Status::kNeedsAnyAlignment);
  if (p.n == 0) return status(Status::kDone);
  set_kernel_fields(p.k, p.num_heads, k_head_bytes, vec);
  set_kernel_fields(p.v, p.num_heads, v_head_bytes, vec);
  const int device = p.device.device_id;
  const DeviceInfo info = jitkv::cuda::device_info(device);
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  cudaError_t err;
  if constexpr (kGeneric) {
    err = vec == 16  ? launch<16>(p, table, k_head_bytes, v_head_bytes, info, stream)
          : vec == 8 ? launch<8>(p, table, k_head_bytes, v_head_bytes, info, stream)
          : vec == 4 ? launch<4>(p, table, k_head_bytes, v_head_bytes, info, stream)
          : vec == 2 ? launch<2>(p, table, k_head_bytes, v_head_bytes, info, stream)
                     : launch<1>(p, table, k_head_bytes, v_head_bytes, info, stream);
  } else {  // any other width returned kNeedsAnyAlignment above
    err = launch<16>(p, table, k_head_bytes, v_head_bytes, info, stream);
  }
  jitkv::cuda::check_launch(kOp, err);
  return status(Status::kDone);
}

#if JITKV_PAGE_TABLE
// A page-table build's entry: store_cache's copy of k and v into the caches at the slots FlashInfer's
// table gives (jitkv/page_table.h: batch_indices in slot_mapping's place), walked in the kernel.
int64_t store_cache_table(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache, TensorView batch_indices,
                          TensorView positions, TensorView kv_indices, TensorView kv_indptr, int64_t page_size) {
  StoreCacheParams p =
      parse_params(kOp, k, v, k_cache, v_cache, batch_indices, Optional<TensorView>(), jitkv::codes::kNoSlot,
                   static_cast<int64_t>(KvFormat::kCopy), Optional<TensorView>(), Optional<TensorView>(),
                   jitkv::codes::kMissingScale, jitkv::codes::kMissingScale);
  const jitkv::PageTable table = jitkv::cuda::parse_page_table(kOp, batch_indices, positions, kv_indices, kv_indptr,
                                                               page_size, p.n, p.device, "k_cache");
  return run(p, table);
}
#else
int64_t store_cache(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache, TensorView slot_mapping,
                    Optional<TensorView> loc_map, int64_t skip_slot, int64_t kv_cache_dtype,
                    Optional<TensorView> k_scale, Optional<TensorView> v_scale, double k_scale_value,
                    double v_scale_value) {
  StoreCacheParams p = parse_params(kOp, k, v, k_cache, v_cache, slot_mapping, loc_map, skip_slot, kv_cache_dtype,
                                    k_scale, v_scale, k_scale_value, v_scale_value);
  return run(p, jitkv::PageTable{});
}
#endif

}  // namespace

#if JITKV_PAGE_TABLE
TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_cache_table, store_cache_table);
#else
TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_cache, store_cache);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_cache_copy, store_cache_copy<store_cache>);
#endif
