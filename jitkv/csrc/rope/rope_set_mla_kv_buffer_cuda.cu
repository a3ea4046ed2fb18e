// tvm-ffi binding of rope_set_mla_kv_buffer on CUDA: parses and checks the arguments (parse.h), checks
// them against this module's template arguments, builds the kernel's block (params.h MlaArgs) and
// launches rope_set_mla_kv_buffer_kernel (mla_kernels.cuh) on the caller's current stream, with PDL from
// sm_90.
//
// Template arguments (JitSpec args; ops/rope.py cuda_mla_spec): JITKV_NOPE, JITKV_ROPE (values per row of
// kv_c and k_pe), JITKV_SRC_DTYPE (codes::SrcDtype), JITKV_Q_MODE (codes::RopeQ), JITKV_KV_DTYPE
// (codes::KvFormat), JITKV_PAGE_TABLE (1: the rows' slots come from FlashInfer's page table, read in the
// kernel: jitkv/page_table.h, and the rows' rope parts may go to a cache of their own; such a build exports
// rope_set_mla_kv_buffer_table only), JITKV_PDL. One module serves NeoX and GPT-J and both cos/sin dtypes
// (a kernel each, kernel_of). Which variants build is decided in Python before building (ops/rope.py
// cuda_mla_refusal).
//
// Returns codes::Status: kNeedsAnyAlignment, before launching, for views the kernel's 16-byte lanes
// cannot address, or a q_nope width that is no whole number of lanes; the op then runs Triton.
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

#include "jitkv/codes.h"
#include "jitkv/cuda/launch.cuh"
#include "jitkv/cuda/paged.cuh"
#include "rope/mla_kernels.cuh"
#include "rope/params.h"
#include "rope/parse.h"

namespace {

using namespace jitkv::rope;
using jitkv::codes::Status;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;

constexpr const char* kOp = "rope_set_mla_kv_buffer";
using Shape = MlaShape<JITKV_NOPE, JITKV_ROPE, static_cast<SrcDtype>(JITKV_SRC_DTYPE), static_cast<RopeQ>(JITKV_Q_MODE),
                       static_cast<KvFormat>(JITKV_KV_DTYPE), JITKV_PAGE_TABLE != 0>;
constexpr bool kPdl = JITKV_PDL != 0;
constexpr int kEs = elem_bytes_of<Shape::kSrc>();

void mismatch(const char* name, const char* what) {
  TVM_FFI_THROW(ValueError) << kOp << ": " << name << ": this module was built for another " << what;
}

void check_module(const MlaParams& p) {
  if (p.kv.device.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << kOp << ": kv_buffer: expected a CUDA tensor, got " << jitkv::device_str(p.kv.device);
  }
  if (src_dtype(p.kv.dtype) != Shape::kSrc) mismatch("kv_c", "dtype");
  if (p.kv.nope_bytes != Shape::kNope * kEs || p.kv.rope_bytes != Shape::kRope * kEs) mismatch("kv_c", "width");
  if (p.q.mode != Shape::kQ) mismatch("q_out", "query mode");
  if (p.kv.kv_format != Shape::kFmt) mismatch("kv_cache_dtype", "format");
}

using jitkv::aligned;

// Where a paged build writes the rows' rope parts: slot s's at dst + s * stride (PagedMlaArgs rope_dst).
struct RopeRows {
  char* dst;
  int64_t stride;
};

// A paged build's block takes the rope rows; the others' have no room for them.
template <bool kPaged, class Block>
void set_rope_rows(Block& block, const RopeRows& rope) {
  if constexpr (kPaged) block.rope_dst = rope.dst, block.rope_dst_stride = rope.stride;
}

// Every vector access at its width: the sources by 16 bytes, the row and q's destination by lanes
// (fp8_ds_mla rows by 16: their rope part is 16-bit lanes), the cos/sin rows by 16 bytes; NeoX halves of
// whole lanes.
bool kernel_takes(const MlaParams& p, const RopeRows& rope) {
  if (p.rot.neox && !LaneRotation<Shape::kRope, true, Shape::kV>::kOk) return false;
  constexpr int kRowLane = Shape::kDs ? 16 : dst_lane_bytes<Shape::kSrc, Shape::kFmt>();
  constexpr int kQLane = dst_lane_bytes<Shape::kSrc, q_format(Shape::kQ)>();
  return aligned(p.kv.dst, kRowLane, {p.kv.dst_row_stride}) && aligned(rope.dst, kRowLane, {rope.stride}) &&
         aligned(p.kv.nope, 16, {p.kv.nope_row_stride}) && aligned(p.kv.rope, 16, {p.kv.rope_row_stride}) &&
         aligned(p.k_pe_out.ptr, 16, {p.k_pe_out.stride_token}) &&
         aligned(p.q.src.ptr, 16, {p.q.src.stride_token, p.q.src.stride_head}) &&
         aligned(p.q_nope.ptr, 16, {p.q_nope.stride_token, p.q_nope.stride_head}) &&
         aligned(p.q.dst.ptr, kQLane, {p.q.dst.stride_token, p.q.dst.stride_head}) &&
         aligned(p.rot.cos_sin, 16, {p.rot.cs_stride}) && p.nope_q % Shape::kV == 0;
}

Shape::Args kernel_args(const MlaParams& p, const jitkv::PageTable& pages, const RopeRows& rope) {
  Shape::Args a;
  a.dst = p.kv.dst;
  a.kv_c = p.kv.nope;
  a.k_pe = p.kv.rope;
  a.q_pe = p.q.src.ptr;
  a.q_nope = p.q_nope.ptr;
  a.k_pe_out = p.k_pe_out.ptr;
  a.q_dst = p.q.dst.ptr;
  a.loc = p.kv.loc;
  a.positions = p.rot.positions;
  a.cos_sin = p.rot.cos_sin;
  const bool fp8 = Shape::kFmt == KvFormat::kE4M3 || Shape::kFmt == KvFormat::kE5M2;
  a.scale_ptr = fp8 ? p.kv.scale_ptr : nullptr;
  a.scale = fp8 ? p.kv.scale : 1.0f;
  a.q_scale_ptr = p.q.scale_ptr;
  a.q_scale = p.q.scale;
  a.dst_stride = p.kv.dst_row_stride;
  a.kv_c_stride = p.kv.nope_row_stride;
  a.k_pe_stride = p.kv.rope_row_stride;
  a.k_pe_out_stride = p.k_pe_out.stride_token;
  a.q_pe_token = p.q.src.stride_token, a.q_pe_head = p.q.src.stride_head;
  a.q_nope_token = p.q_nope.stride_token, a.q_nope_head = p.q_nope.stride_head;
  a.q_dst_token = p.q.dst.stride_token, a.q_dst_head = p.q.dst.stride_head;
  a.cs_stride = p.rot.cs_stride;
  a.n = p.kv.n;
  a.max_pos = p.rot.max_pos;
  a.num_slots = p.kv.num_slots;
  a.skip_slot = p.kv.skip_slot;
  a.q_heads = static_cast<int32_t>(p.q.heads);
  a.nope_q_lanes = static_cast<int32_t>(p.nope_q / Shape::kV);
  a.loc_i64 = p.kv.loc_i64, a.pos_i64 = p.rot.pos_i64;
  jitkv::cuda::set_page_table<Shape::kPaged>(a, pages);
  set_rope_rows<Shape::kPaged>(a, rope);
  return a;
}

// The kernel of the call's rotation, cos/sin dtype and heads per thread.
auto kernel_of(const Rotation& rot, int hpt) {
  return with_rotation<Shape::kRope, Shape::kSrc, false>(rot, hpt, [](auto neox, auto cs, auto h) {
    return rope_set_mla_kv_buffer_kernel<Shape, decltype(h)::value, decltype(neox)::value, decltype(cs)::value>;
  });
}

int64_t status(Status s) { return static_cast<int64_t>(s); }

// The parsed call's launch (pages, rope: a paged build's table and rope rows, else unused):
// kNeedsAnyAlignment for views the kernel cannot address, else kDone after the launch.
int64_t run(const MlaParams& p, const jitkv::PageTable& pages, const RopeRows& rope) {
  if (!kernel_takes(p, rope)) return status(Status::kNeedsAnyAlignment);
  if (p.kv.n == 0) return status(Status::kDone);
  const int device = p.kv.device.device_id;
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(device);
  const int nope_q_lanes = static_cast<int>(p.nope_q / Shape::kV);
  const int hpt =
      heads_per_thread(p.q.heads % kBulkHpt == 0,  // query heads per thread (geometry.h)
                       p.kv.n * Shape::token_threads(p.q.heads, nope_q_lanes, 1), info.sms, kMlaThreadsPerSm);
  const int64_t threads = Shape::token_threads(p.q.heads, nope_q_lanes, hpt);
  if (p.kv.n > INT32_MAX || threads > int64_t(kBlockThreads) * 65535) {
    TVM_FFI_THROW(ValueError) << kOp << ": q_pe: " << p.kv.n << " tokens of " << p.q.heads
                              << " query heads are too many for the CUDA kernel";
  }
  const int most = mla_block_threads(hpt, p.kv.n * threads, info.sms);
  const int block = static_cast<int>(threads < most ? threads : most);
  const dim3 grid(static_cast<unsigned>(p.kv.n), static_cast<unsigned>((threads + block - 1) / block));
  jitkv::cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  jitkv::cuda::check_launch(kOp, jitkv::cuda::launch(kernel_of(p.rot, hpt), grid, dim3(block), stream,
                                                     kPdl && info.pdl(), kernel_args(p, pages, rope)));
  return status(Status::kDone);
}

#if JITKV_PAGE_TABLE
// kpe_rows [num_slots, >= rope] of kv_buffer's dtype: the rows' rope parts, in memory no other output
// shares.
RopeRows rope_rows(const MlaParams& p, const TensorView& kv_buffer, const TensorView& kpe_rows,
                   const Optional<TensorView>& q_pe, const Optional<TensorView>& q_out,
                   const Optional<TensorView>& k_pe_out) {
  jitkv::check_device(kOp, "kpe_rows", kpe_rows, p.kv.device, "kv_buffer");
  jitkv::check_same_dtype(kOp, "kpe_rows", kpe_rows, kv_buffer.dtype(), "kv_buffer");
  require(kpe_rows.ndim() == 2 && kpe_rows.size(0) == kv_buffer.size(0), kOp, "kpe_rows",
          "expected 2-D rows, as many as kv_buffer's");
  require(kpe_rows.size(1) >= Shape::kRope, kOp, "kpe_rows", "expected rows of at least k_pe's width");
  jitkv::check_last_dim_contiguous(kOp, "kpe_rows", kpe_rows);
  jitkv::check_written(kOp, "kpe_rows", kpe_rows);
  jitkv::check_disjoint(kOp, "kpe_rows", kpe_rows, "kv_buffer", kv_buffer);
  if (q_out.has_value()) jitkv::check_disjoint(kOp, "q_out", q_out.value(), "kpe_rows", kpe_rows);
  if (k_pe_out.has_value()) jitkv::check_disjoint(kOp, "k_pe_out", k_pe_out.value(), "kpe_rows", kpe_rows);
  if (p.q.mode == RopeQ::kInPlace) jitkv::check_disjoint(kOp, "q_pe", q_pe.value(), "kpe_rows", kpe_rows);
  return RopeRows{jitkv::data_ptr(kpe_rows), kpe_rows.stride(0) * jitkv::elem_bytes(kpe_rows.dtype())};
}

// A paged build's entry: rope_set_mla_kv_buffer with the rows' slots FlashInfer's table gives
// (jitkv/page_table.h: batch_indices in loc's place, page_positions the rows' positions in their
// requests; kv_buffer's rows are the pages' rows, page after page), walked in the kernel. kpe_rows: the
// rope parts' rows (FlashInfer's separate kpe cache; kv_buffer's rows then hold kv_c only), else
// None: after kv_c in kv_buffer's rows.
int64_t rope_set_mla_kv_buffer_table(TensorView kv_buffer, TensorView batch_indices, TensorView kv_c, TensorView k_pe,
                                     TensorView positions, TensorView cos_sin_cache, bool is_neox,
                                     Optional<TensorView> q_pe, Optional<TensorView> q_nope, Optional<TensorView> q_out,
                                     int64_t q_mode, Optional<TensorView> q_scale, double q_scale_value,
                                     Optional<TensorView> k_pe_out, int64_t skip_slot, int64_t kv_format,
                                     Optional<TensorView> scale, double scale_value, TensorView page_positions,
                                     TensorView kv_indices, TensorView kv_indptr, int64_t page_size,
                                     Optional<TensorView> kpe_rows) {
  const MlaParams p = parse_mla(kOp, kv_buffer, batch_indices, kv_c, k_pe, positions, cos_sin_cache, is_neox, q_pe,
                                q_nope, q_out, q_mode, q_scale, q_scale_value, k_pe_out, skip_slot, kv_format, scale,
                                scale_value, kpe_rows.has_value());
  check_module(p);
  if (p.kv.skip_slot != jitkv::codes::kNoSlot) mismatch("skip_slot", "slot source (a page table, with no skip_slot)");
  const RopeRows rope =
      kpe_rows.has_value()
          ? rope_rows(p, kv_buffer, kpe_rows.value(), q_pe, q_out, k_pe_out)
          : RopeRows{p.kv.dst + Shape::kNopeLanes * dst_lane_bytes<Shape::kSrc, Shape::kFmt>(), p.kv.dst_row_stride};
  const jitkv::PageTable pages = jitkv::cuda::parse_page_table(kOp, batch_indices, page_positions, kv_indices,
                                                               kv_indptr, page_size, p.kv.n, p.kv.device, "kv_buffer");
  return run(p, pages, rope);
}
#else
int64_t rope_set_mla_kv_buffer(TensorView kv_buffer, TensorView loc, TensorView kv_c, TensorView k_pe,
                               TensorView positions, TensorView cos_sin_cache, bool is_neox, Optional<TensorView> q_pe,
                               Optional<TensorView> q_nope, Optional<TensorView> q_out, int64_t q_mode,
                               Optional<TensorView> q_scale, double q_scale_value, Optional<TensorView> k_pe_out,
                               int64_t skip_slot, int64_t kv_format, Optional<TensorView> scale, double scale_value) {
  const MlaParams p = parse_mla(kOp, kv_buffer, loc, kv_c, k_pe, positions, cos_sin_cache, is_neox, q_pe, q_nope, q_out,
                                q_mode, q_scale, q_scale_value, k_pe_out, skip_slot, kv_format, scale, scale_value);
  check_module(p);
  return run(p, jitkv::PageTable{}, RopeRows{nullptr, 0});
}
#endif

}  // namespace

#if JITKV_PAGE_TABLE
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_set_mla_kv_buffer_table, rope_set_mla_kv_buffer_table);
#else
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_set_mla_kv_buffer, rope_set_mla_kv_buffer);
#endif
