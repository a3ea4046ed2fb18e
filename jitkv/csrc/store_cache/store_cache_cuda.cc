// tvm-ffi binding of the CUDA store_cache (store_cache_cuda.cu): validates the arguments
// (parse_store_cache_args), checks that they fit this module's template arguments, builds the
// kernel's parameter block and launches on the caller's current stream of the tensors' device.
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "store_cache/store_cache.cuh"
#include "store_cache/store_cache_args.h"

namespace {

namespace sc = jitkv::store_cache;
using jitkv::StoreCacheArgs;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;

constexpr const char* kOp = "store_cache";
constexpr int kKHeadBytes = JITKV_K_HEAD_BYTES;
constexpr int kVHeadBytes = JITKV_V_HEAD_BYTES;
constexpr sc::SrcType kSrc = static_cast<sc::SrcType>(JITKV_SRC_DTYPE);
constexpr sc::Fp8 kFp8 = static_cast<sc::Fp8>(JITKV_KV_DTYPE);
constexpr bool kGeneric = kKHeadBytes == 0;
constexpr int kRatio = sc::src_ratio(kSrc, kFp8);

sc::SrcType src_type_of(DLDataType d) {
  if (d.code == kDLBfloat) return sc::SrcType::kBF16;
  if (d.code == kDLFloat && d.bits == 16) return sc::SrcType::kF16;
  return sc::SrcType::kF32;
}

// Largest power of two <= 16 dividing every value (0 divides into anything).
int64_t common_alignment(std::initializer_list<int64_t> values) {
  uint64_t bits = 16;
  for (int64_t v : values) bits |= static_cast<uint64_t>(v);
  return static_cast<int64_t>(bits & (~bits + 1));
}

// Alignment of one side. Strides of size-1 dims never enter an address, so they do not count.
int64_t dst_alignment(const jitkv::CacheGeom& c, int64_t heads, int64_t head_bytes) {
  const bool one_block = c.num_slots <= c.block_size;
  return common_alignment({reinterpret_cast<int64_t>(c.base), head_bytes, one_block ? 0 : c.stride_block,
                           c.block_size == 1 ? 0 : c.stride_token, heads == 1 ? 0 : c.stride_head});
}

int64_t src_alignment(const jitkv::SrcGeom& s, int64_t n, int64_t heads) {
  return common_alignment(
      {reinterpret_cast<int64_t>(s.base), n == 1 ? 0 : s.stride_token, heads == 1 ? 0 : s.stride_head});
}

// Destination vector width: every cache address is a multiple of it, every source address a multiple
// of the bytes one source load covers (min(16, vec * ratio)).
int pick_vec(const StoreCacheArgs& a, int64_t k_head_bytes, int64_t v_head_bytes) {
  int64_t vec = std::min(dst_alignment(a.k_cache, a.num_heads, k_head_bytes),
                         dst_alignment(a.v_cache, a.num_heads, v_head_bytes));
  int64_t src = std::min(src_alignment(a.k, a.n, a.num_heads), src_alignment(a.v, a.n, a.num_heads));
  while (vec > 1 && std::min<int64_t>(16, vec * kRatio) > src) vec /= 2;
  return static_cast<int>(vec);
}

void check_build(const StoreCacheArgs& a, int64_t k_head_bytes, int64_t v_head_bytes, int vec) {
  const int kv = static_cast<int>(a.kv_dtype);
  if (kv != JITKV_KV_DTYPE) {
    TVM_FFI_THROW(ValueError) << kOp << ": kv_cache_dtype: this module was built for JITKV_KV_DTYPE="
                              << JITKV_KV_DTYPE << ", got " << kv;
  }
  if (kFp8 != sc::Fp8::kNone && src_type_of(a.src_dtype) != kSrc) {
    TVM_FFI_THROW(ValueError) << kOp << ": k: this module was built for JITKV_SRC_DTYPE=" << JITKV_SRC_DTYPE
                              << ", got dtype " << a.src_dtype;
  }
  if (kGeneric) return;
  if (k_head_bytes != kKHeadBytes || v_head_bytes != kVHeadBytes) {
    TVM_FFI_THROW(ValueError) << kOp << ": k_cache: this module was built for " << kKHeadBytes << "/"
                              << kVHeadBytes << " cache bytes per K/V head, got " << k_head_bytes << "/"
                              << v_head_bytes;
  }
  if (vec != 16) {
    TVM_FFI_THROW(ValueError) << kOp << ": k: an address or stride of k/v/k_cache/v_cache is only " << vec
                              << "-byte aligned; this module needs 16 (use the generic build, "
                              << "JITKV_K_HEAD_BYTES=0 and JITKV_V_HEAD_BYTES=0)";
  }
}

bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// Division of a slot by block_size as (umulhi(slot, magic) + slot) >> shift (round-up method:
// shift = ceil(log2(block_size)), magic = floor(2^32 (2^shift - block_size) / block_size) + 1). Exact
// for slots < 2^32; for a power of two magic is 1, umulhi is 0 and the shift is exact for any slot.
void set_block_division(sc::Side& d, int64_t block_size) {
  int32_t shift = 0;
  while ((int64_t(1) << shift) < block_size) ++shift;
  d.block_shift = shift;
  d.block_magic = static_cast<uint32_t>((((uint64_t(1) << shift) - uint64_t(block_size)) << 32) / uint64_t(block_size) + 1);
}

sc::Side make_side(const jitkv::SrcGeom& s, const jitkv::CacheGeom& c, int64_t heads, int64_t head_bytes, int vec,
                   const float* scale_ptr, float scale) {
  sc::Side d;
  d.src = s.base;
  d.src_stride_token = s.stride_token;
  d.src_stride_head = s.stride_head;
  d.dst = c.base;
  d.num_slots = c.num_slots;
  d.block_size = c.block_size;
  d.dst_stride_block = c.stride_block;
  d.dst_stride_token = c.stride_token;
  d.dst_stride_head = c.stride_head;
  d.head_vecs = static_cast<int32_t>(head_bytes / vec);
  d.row_vecs = static_cast<int32_t>(heads * head_bytes / vec);
  set_block_division(d, c.block_size);
  d.scale_ptr = scale_ptr;
  d.scale = scale;
  return d;
}

void store_cache(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache, TensorView slot_mapping,
                 Optional<TensorView> loc_map, int64_t skip_slot, int64_t kv_cache_dtype,
                 Optional<TensorView> k_scale, Optional<TensorView> v_scale, double k_scale_value,
                 double v_scale_value) {
  StoreCacheArgs a = jitkv::parse_store_cache_args(kOp, k, v, k_cache, v_cache, slot_mapping, loc_map, skip_slot,
                                                   kv_cache_dtype, k_scale, v_scale, k_scale_value, v_scale_value);
  if (a.device.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << kOp << ": k_cache: expected a CUDA tensor, got device_type "
                              << a.device.device_type;
  }
  const int64_t cache_elem = a.kv_dtype == jitkv::KVDtype::kAuto ? jitkv::elem_bytes(a.src_dtype) : 1;
  const int64_t k_head_bytes = a.k_head_dim * cache_elem, v_head_bytes = a.v_head_dim * cache_elem;
  const int vec = pick_vec(a, k_head_bytes, v_head_bytes);
  check_build(a, k_head_bytes, v_head_bytes, vec);
  const int64_t row_vecs = a.num_heads * std::max(k_head_bytes, v_head_bytes) / vec;
  if ((row_vecs + 31) / 32 > 65535) {  // grid.y = chunks of at least 32 vectors
    TVM_FFI_THROW(ValueError) << kOp << ": k: rows of " << a.num_heads << " x " << a.k_head_dim
                              << " elements are too large for the CUDA kernel";
  }
  for (const jitkv::CacheGeom* c : {&a.k_cache, &a.v_cache}) {
    if (!is_pow2(c->block_size) && c->num_slots > int64_t(UINT32_MAX)) {
      TVM_FFI_THROW(ValueError) << kOp << ": k_cache: a block_size that is not a power of two (" << c->block_size
                                << ") needs fewer than 2^32 slots, got " << c->num_slots;
    }
  }
  if (a.n == 0) return;

  sc::Params p;
  p.k = make_side(a.k, a.k_cache, a.num_heads, k_head_bytes, vec, a.k_scale_ptr, a.k_scale_value);
  p.v = make_side(a.v, a.v_cache, a.num_heads, v_head_bytes, vec, a.v_scale_ptr, a.v_scale_value);
  p.slots = a.slot_mapping;
  p.loc_map = a.loc_map;
  p.loc_map_size = a.loc_map_size;
  p.n = a.n;
  p.skip_slot = a.skip_slot;
  p.slot_i64 = a.slot_i64;
  p.loc_i64 = a.loc_map_i64;
  p.same_blocks = p.k.block_size == p.v.block_size;

  const int32_t device = a.device.device_id;
  const char* err = jitkv_store_cache_launch(&p, vec, device, TVMFFIEnvGetStream(kDLCUDA, device));
  if (err != nullptr) TVM_FFI_THROW(RuntimeError) << kOp << ": CUDA launch failed: " << err;
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_cache, store_cache);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_cache_copy, jitkv::store_cache_copy<store_cache>);
