// tvm-ffi binding of rope_store_cache on CUDA: parses and checks the arguments (parse.h), checks them
// against this module's template arguments, builds the kernel's block (params.h StoreArgs) and launches
// rope_store_cache_kernel (kernels.cuh) on the caller's current stream, with PDL from sm_90.
//
// Template arguments (JitSpec args; ops/rope.py cuda_spec): JITKV_HEAD_DIM, JITKV_V_HEAD_DIM,
// JITKV_ROTARY_DIM, JITKV_SRC_DTYPE (codes::SrcDtype), JITKV_Q_MODE (codes::RopeQ), JITKV_KV_DTYPE
// (codes::KvFormat: copy, e4m3 or e5m2), JITKV_NORMS (codes::RopeNorm bits: which heads are normed),
// JITKV_NORM_DTYPE (codes::SrcDtype of the norm weights, NONE without norms), JITKV_PAGE_TABLE (1: the
// slots come from FlashInfer's page table, read in the kernel: jitkv/page_table.h; such a build exports
// rope_store_cache_table only), JITKV_PDL. One module serves NeoX and GPT-J and both cos/sin dtypes (a
// kernel each, kernel_of). Which variants build is decided in Python before building (ops/rope.py
// cuda_refusal: heads of at most 32 lanes of 16 bytes, NeoX halves of whole lanes, norm weights float32 or
// of the sources' dtype).
//
// Returns codes::Status: kNeedsAnyAlignment, before launching, for views the kernel's 16-byte lanes
// cannot address (a base address or stride that is not a multiple of a lane's bytes), a paged cache
// whose block division the kernel cannot do exactly, or (a page-table build) a page size that is not the
// caches' block size; the op then runs the next backend (Triton), the FlashInfer shim its two launches.
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

#include "jitkv/codes.h"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/paged.cuh"
#include "rope/kernels.cuh"
#include "rope/params.h"
#include "rope/parse.h"

namespace {

using namespace jitkv::rope;
using jitkv::codes::Status;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;

constexpr const char* kOp = "rope_store_cache";
using Shape = StoreShape<JITKV_HEAD_DIM, JITKV_V_HEAD_DIM, JITKV_ROTARY_DIM, static_cast<SrcDtype>(JITKV_SRC_DTYPE),
                         static_cast<RopeQ>(JITKV_Q_MODE), static_cast<KvFormat>(JITKV_KV_DTYPE), JITKV_NORMS,
                         static_cast<SrcDtype>(JITKV_NORM_DTYPE), JITKV_PAGE_TABLE != 0>;
constexpr bool kPdl = JITKV_PDL != 0;

void mismatch(const char* name, const char* what) {
  TVM_FFI_THROW(ValueError) << kOp << ": " << name << ": this module was built for another " << what;
}

// The call against the module's template arguments (the Python side picks the module from the same
// fields, so a mismatch is a wrong module, not bad input).
void check_module(const StoreParams& p, DLDevice dev) {
  if (dev.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << kOp << ": k_cache: expected a CUDA tensor, got " << jitkv::device_str(dev);
  }
  if (src_dtype(p.kv.src_dtype) != Shape::kSrc) mismatch("q", "dtype");
  if (p.kv.k_head_dim != Shape::kD || p.kv.v_head_dim != Shape::kDv) mismatch("k", "head dim");
  if (p.rot.rot != Shape::kRot) mismatch("rotary_dim", "rotary dim");
  if (p.q.mode != Shape::kQ) mismatch("q_out", "query mode");
  if (p.kv.kv_dtype != Shape::kFmt) mismatch("kv_cache_dtype", "cache format");
  const int norms = (p.q_norm != nullptr ? RopeNorm::kQ : 0) | (p.k_norm != nullptr ? RopeNorm::kK : 0);
  if (norms != Shape::kNorms || (norms != 0 && p.norm_dtype != Shape::kNormDtype)) {
    mismatch("q_norm_weight", "set of norms or weight dtype");
  }
}

using jitkv::aligned;

// Every vector access of the kernel at its width: sources, q's destination, k_out and the caches by
// lanes; the cos/sin rows and the norm weights by 16 bytes; NeoX halves of whole lanes.
bool kernel_takes(const StoreParams& p) {
  if (p.rot.neox && !LaneRotation<Shape::kRot, true, Shape::kV>::kOk) return false;
  constexpr int kQLane = dst_lane_bytes<Shape::kSrc, q_format(Shape::kQ)>();
  constexpr int kKvLane = dst_lane_bytes<Shape::kSrc, Shape::kFmt>();
  const auto& k = p.kv.k;
  const auto& v = p.kv.v;
  return aligned(p.q.src.ptr, 16, {p.q.src.stride_token, p.q.src.stride_head}) &&
         aligned(p.q.dst.ptr, kQLane, {p.q.dst.stride_token, p.q.dst.stride_head}) &&
         aligned(k.src, 16, {k.src_stride_token, k.src_stride_head}) &&
         aligned(v.src, 16, {v.src_stride_token, v.src_stride_head}) &&
         aligned(p.k_out.ptr, 16, {p.k_out.stride_token, p.k_out.stride_head}) &&
         aligned(k.dst, kKvLane, {k.dst_stride_block, k.dst_stride_token, k.dst_stride_head}) &&
         aligned(v.dst, kKvLane, {v.dst_stride_block, v.dst_stride_token, v.dst_stride_head}) &&
         aligned(p.rot.cos_sin, 16, {p.rot.cs_stride}) && aligned(p.q_norm, 16) && aligned(p.k_norm, 16) &&
         jitkv::cuda::block_division_exact(k.block_size, k.num_slots) &&
         jitkv::cuda::block_division_exact(v.block_size, v.num_slots);
}

// A paged build's block strides and block counts (kernels.cuh paged_row); the other builds' block has none.
template <bool kPaged, class Block>
void set_paged_rows(Block& a, const StoreParams& p) {
  if constexpr (kPaged) {
    a.k_block_stride = p.kv.k.dst_stride_block, a.v_block_stride = p.kv.v.dst_stride_block;
    a.k_blocks = p.kv.k.num_slots / p.kv.k.block_size, a.v_blocks = p.kv.v.num_slots / p.kv.v.block_size;
  }
}

Shape::Args kernel_args(const StoreParams& p, const jitkv::PageTable& pages) {
  const auto& k = p.kv.k;
  const auto& v = p.kv.v;
  const jitkv::cuda::BlockDivision kd = jitkv::cuda::block_division(k.block_size);
  const jitkv::cuda::BlockDivision vd = jitkv::cuda::block_division(v.block_size);
  Shape::Args a;
  a.q_src = p.q.src.ptr;
  a.k_src = k.src;
  a.v_src = v.src;
  a.q_dst = p.q.dst.ptr;
  a.k_out = p.k_out.ptr;
  a.k_cache = const_cast<char*>(k.dst);
  a.v_cache = const_cast<char*>(v.dst);
  a.slots = p.kv.slots;
  a.loc_map = p.kv.loc_map;
  a.positions = p.rot.positions;
  a.cos_sin = p.rot.cos_sin;
  a.q_norm = static_cast<const char*>(p.q_norm);
  a.k_norm = static_cast<const char*>(p.k_norm);
  a.q_scale_ptr = p.q.scale_ptr;
  a.k_scale_ptr = k.scale_ptr;
  a.v_scale_ptr = v.scale_ptr;
  a.q_src_token = p.q.src.stride_token, a.q_src_head = p.q.src.stride_head;
  a.q_dst_token = p.q.dst.stride_token, a.q_dst_head = p.q.dst.stride_head;
  a.k_src_token = k.src_stride_token, a.k_src_head = k.src_stride_head;
  a.v_src_token = v.src_stride_token, a.v_src_head = v.src_stride_head;
  a.k_out_token = p.k_out.stride_token, a.k_out_head = p.k_out.stride_head;
  a.k_token = k.dst_stride_token, a.k_head = k.dst_stride_head;
  a.k_block_adj = jitkv::cuda::block_adj(k.dst_stride_block, k.block_size, k.dst_stride_token);
  a.v_token = v.dst_stride_token, a.v_head = v.dst_stride_head;
  a.v_block_adj = jitkv::cuda::block_adj(v.dst_stride_block, v.block_size, v.dst_stride_token);
  a.cs_stride = p.rot.cs_stride;
  a.n = p.kv.n;
  a.max_pos = p.rot.max_pos;
  a.k_num_slots = k.num_slots, a.v_num_slots = v.num_slots;
  a.skip_slot = p.kv.skip_slot;
  a.loc_map_size = p.kv.loc_map_size;
  a.k_magic = kd.magic, a.k_shift = kd.shift;
  a.v_magic = vd.magic, a.v_shift = vd.shift;
  a.q_scale = p.q.scale, a.k_scale = k.scale, a.v_scale = v.scale;
  a.eps = p.eps;
  a.k_scale_stride = k.scale_stride, a.v_scale_stride = v.scale_stride;
  a.q_heads = static_cast<int32_t>(p.q.heads), a.kv_heads = static_cast<int32_t>(p.kv.num_heads);
  a.slot_i64 = p.kv.slot_i64, a.loc_i64 = p.kv.loc_i64, a.pos_i64 = p.rot.pos_i64;
  jitkv::cuda::set_page_table<Shape::kPaged>(a, pages);
  set_paged_rows<Shape::kPaged>(a, p);
  return a;
}

// The kernel of the call's rotation, cos/sin dtype and heads per thread.
auto kernel_of(const Rotation& rot, int hpt) {
  return with_rotation<Shape::kRot, Shape::kSrc, Shape::kPairs>(rot, hpt, [](auto neox, auto cs, auto h) {
    return rope_store_cache_kernel<Shape, decltype(h)::value, decltype(neox)::value, decltype(cs)::value>;
  });
}

int64_t status(Status s) { return static_cast<int64_t>(s); }

// The parsed call's launch (pages: a paged build's table, else unused): kNeedsAnyAlignment for views the
// kernel cannot address, else kDone after the launch.
int64_t run(const StoreParams& p, const jitkv::PageTable& pages) {
  if (!kernel_takes(p)) return status(Status::kNeedsAnyAlignment);
  if (p.kv.n == 0) return status(Status::kDone);
  const int device = p.kv.device.device_id;
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(device);
  const int64_t at_one = p.kv.n * Shape::token_threads(p.q.heads, p.kv.num_heads, 1);
  const int hpt = mha_heads_per_thread(p.q.heads, p.kv.num_heads, at_one, info.sms, Shape::kPairs);
  const int64_t threads = Shape::token_threads(p.q.heads, p.kv.num_heads, hpt);
  if (p.kv.n > INT32_MAX || threads > int64_t(kBlockThreads) * 65535) {
    TVM_FFI_THROW(ValueError) << kOp << ": q: " << p.kv.n << " tokens of " << p.q.heads << " + 2 x " << p.kv.num_heads
                              << " heads are too many for the CUDA kernel";
  }
  const int most = block_threads(Shape::kNorms != 0, hpt, p.kv.n * threads, info.sms);
  const int block = static_cast<int>(threads < most ? threads : most);
  const dim3 grid(static_cast<unsigned>(p.kv.n), static_cast<unsigned>((threads + block - 1) / block));
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  jitkv::cuda::check_launch(kOp, jitkv::cuda::launch(kernel_of(p.rot, hpt), grid, dim3(block), stream,
                                                     kPdl && info.pdl(), kernel_args(p, pages)));
  return status(Status::kDone);
}

#if JITKV_PAGE_TABLE
// A paged build's entry: rope_store_cache with the slots FlashInfer's table gives (jitkv/page_table.h:
// batch_indices in slot_mapping's place, page_positions the rows' positions in their requests), walked in
// the kernel.
int64_t rope_store_cache_table(TensorView q, TensorView k, TensorView v, TensorView k_cache, TensorView v_cache,
                               TensorView batch_indices, TensorView positions, TensorView cos_sin_cache, bool is_neox,
                               int64_t rotary_dim, Optional<TensorView> q_norm_weight,
                               Optional<TensorView> k_norm_weight, double eps, TensorView q_dst, int64_t q_mode,
                               Optional<TensorView> q_scale, double q_scale_value, Optional<TensorView> k_out,
                               Optional<TensorView> loc_map, int64_t skip_slot, int64_t kv_format,
                               Optional<TensorView> k_scale, Optional<TensorView> v_scale, double k_scale_value,
                               double v_scale_value, TensorView page_positions, TensorView kv_indices,
                               TensorView kv_indptr, int64_t page_size) {
  const StoreParams p =
      parse_store(kOp, q, k, v, k_cache, v_cache, batch_indices, positions, cos_sin_cache, is_neox, rotary_dim,
                  q_norm_weight, k_norm_weight, eps, q_dst, q_mode, q_scale, q_scale_value, k_out, loc_map, skip_slot,
                  kv_format, k_scale, v_scale, k_scale_value, v_scale_value);
  check_module(p, p.kv.device);
  // The kernel addresses a page's rows by the caches' block stride (kernels.cuh paged_row).
  if (p.kv.loc_map != nullptr) mismatch("loc_map", "slot source (a page table, with no loc_map)");
  if (p.kv.skip_slot != jitkv::codes::kNoSlot) mismatch("skip_slot", "slot source (a page table, with no skip_slot)");
  const jitkv::PageTable pages = jitkv::cuda::parse_page_table(kOp, batch_indices, page_positions, kv_indices,
                                                               kv_indptr, page_size, p.kv.n, p.kv.device, "k_cache");
  if (page_size != p.kv.k.block_size || page_size != p.kv.v.block_size) return status(Status::kNeedsAnyAlignment);
  return run(p, pages);
}
#else
int64_t rope_store_cache(TensorView q, TensorView k, TensorView v, TensorView k_cache, TensorView v_cache,
                         TensorView slot_mapping, TensorView positions, TensorView cos_sin_cache, bool is_neox,
                         int64_t rotary_dim, Optional<TensorView> q_norm_weight, Optional<TensorView> k_norm_weight,
                         double eps, TensorView q_dst, int64_t q_mode, Optional<TensorView> q_scale,
                         double q_scale_value, Optional<TensorView> k_out, Optional<TensorView> loc_map,
                         int64_t skip_slot, int64_t kv_format, Optional<TensorView> k_scale,
                         Optional<TensorView> v_scale, double k_scale_value, double v_scale_value) {
  const StoreParams p =
      parse_store(kOp, q, k, v, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, is_neox, rotary_dim,
                  q_norm_weight, k_norm_weight, eps, q_dst, q_mode, q_scale, q_scale_value, k_out, loc_map, skip_slot,
                  kv_format, k_scale, v_scale, k_scale_value, v_scale_value);
  check_module(p, p.kv.device);
  return run(p, jitkv::PageTable{});
}
#endif

}  // namespace

#if JITKV_PAGE_TABLE
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_store_cache_table, rope_store_cache_table);
#else
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_store_cache, rope_store_cache);
#endif
