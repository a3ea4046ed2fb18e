// set_mla_kv_buffer on CPU: kv_buffer[loc[i], :nope] = k_nope[i]; kv_buffer[loc[i], nope:nope+rope] = k_rope[i]
// (set_mla_kv_buffer), or quantized on the way (set_mla_kv_buffer_fp8, set_mla_kv_buffer.cuh's fp8 formats).
//
// Algorithm: parse + validate (set_mla_kv_buffer.cuh, its host part); resolve every slot serially (skip rules,
// IndexError before any write); then one pass over the kept rows writes both segments of each row with AVX-512
// (row_copy.h copy_two). Bytes beyond nope+rope are never touched. OpenMP above a payload threshold;
// when the written lines are cold (scatter.h want_streaming) and rows start on 64-byte lines, whole
// lines are assembled from the two sources and streamed (non-temporal), only a partial last line uses
// a regular masked store.
// fp8: the same row pass with fp8.h's vector conversion (Fp8Quantizer) instead of the copy; fp8_ds_mla
// per tile: abs_max, scale = max(amax / 448, FLT_MIN) (a true division), then the tile by that scale.
#include <tvm/ffi/function.h>

#include "jitkv/cpu/fp8.h"
#include "jitkv/cpu/isa.h"
#include "jitkv/cpu/row_copy.h"
#include "jitkv/cpu/scatter.h"
#include "mla/ds_mla_cpu.h"
#include "mla/parse.h"
#include "mla/rows_cpu.h"

namespace jitkv {
namespace {

constexpr const char* kOp = "set_mla_kv_buffer";

void write_rows(const mla::MlaParams& a, const cpu::RowSlot* rows, int64_t m) {
  int64_t payload = m * (a.nope_bytes + a.rope_bytes);
  int threads = cpu::threads_for(payload);
  bool nt = mla::streamed_rows(a, payload, threads);
  cpu::for_rows(m, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t r = rows[i].row;
      cpu::copy_two(a.dst + rows[i].slot * a.dst_row_stride, a.nope + r * a.nope_row_stride, a.nope_bytes,
                    a.rope + r * a.rope_row_stride, a.rope_bytes, nt);
    }
    if (nt) cpu::stream_fence();
  });
}

void write_fp8_rows(const mla::MlaParams& a, const cpu::RowSlot* rows, int64_t m) {
  const auto format = static_cast<mla::KvFormat>(a.kv_format);
  const cpu::SrcKind kind = cpu::src_kind(a.dtype);
  const cpu::Fp8Format& fmt = cpu::fp8_format(format);
  const int64_t nope = a.nope_bytes / 2, rope = a.rope_bytes / 2;
  // One quantizer, set up once for every row.
  const cpu::Fp8Quantizer quantize(fmt, a.scale_ptr ? *a.scale_ptr : a.scale, kind, m * (nope + rope));
  const int64_t payload = m * (a.nope_bytes + a.rope_bytes);
  const int threads = cpu::threads_for(payload);
  const bool nt = mla::streamed_rows(a, payload, threads);
  cpu::for_rows(m, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      char* dst = a.dst + rows[i].slot * a.dst_row_stride;
      const char* nope_row = a.nope + rows[i].row * a.nope_row_stride;
      const char* rope_row = a.rope + rows[i].row * a.rope_row_stride;
      if (format == mla::KvFormat::kDsMla) {
        mla::write_ds_mla(dst, kind, nope_row, rope_row, nt);
      } else {
        quantize(reinterpret_cast<uint8_t*>(dst), kind, nope_row, nope, nt);
        quantize(reinterpret_cast<uint8_t*>(dst) + nope, kind, rope_row, rope, nt && nope % 64 == 0);
      }
    }
    if (nt) cpu::stream_fence();
  });
}

// Kept (row, slot) pairs of the KV-write contract, IndexError before anything is written.
int64_t resolve(const mla::MlaParams& a, cpu::RowSlot* out) {
  return a.loc_i64 ? cpu::resolve_slots(kOp, "loc", static_cast<const int64_t*>(a.loc), a.n, a.skip_slot, nullptr,
                                        false, 0, a.num_slots, out)
                   : cpu::resolve_slots(kOp, "loc", static_cast<const int32_t*>(a.loc), a.n, a.skip_slot, nullptr,
                                        false, 0, a.num_slots, out);
}

void check_cpu(const TensorView& kv_buffer) {
  if (kv_buffer.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << kOp << ": kv_buffer: expected a CPU tensor for the CPU kernel, got device_type "
                              << kv_buffer.device().device_type;
  }
}

void set_mla_kv_buffer_fp8_cpu(TensorView kv_buffer, TensorView loc, TensorView k_nope, TensorView k_rope,
                               int64_t skip_slot, int64_t kv_format, Optional<TensorView> scale, double scale_value) {
  check_cpu(kv_buffer);
  const mla::MlaParams a =
      mla::parse_fp8_params(kOp, kv_buffer, loc, k_nope, k_rope, skip_slot, kv_format, scale, scale_value);
  if (a.n == 0) return;
  cpu::RowSlotBuffer buf(a.n);
  const int64_t m = resolve(a, buf.data());
  if (m > 0) write_fp8_rows(a, buf.data(), m);
}

void set_mla_kv_buffer_cpu(TensorView kv_buffer, TensorView loc, TensorView k_nope, TensorView k_rope,
                           int64_t skip_slot) {
  check_cpu(kv_buffer);
  const mla::MlaParams a = mla::parse_params(kOp, kv_buffer, loc, k_nope, k_rope, skip_slot);
  if (a.n == 0) return;
  cpu::RowSlotBuffer buf(a.n);
  const int64_t m = resolve(a, buf.data());
  if (m > 0) write_rows(a, buf.data(), m);
}

}  // namespace
}  // namespace jitkv

TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_mla_kv_buffer, jitkv::set_mla_kv_buffer_cpu);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_mla_kv_buffer_fp8, jitkv::set_mla_kv_buffer_fp8_cpu);
JITKV_CPU_EXPORT_INFO();
