// set_mla_kv_buffer on CPU: kv_buffer[loc[i], :nope] = k_nope[i]; kv_buffer[loc[i], nope:nope+rope] = k_rope[i].
//
// Algorithm: parse + validate (set_mla_kv_buffer.cuh, its host part); resolve every slot serially (skip rules, IndexError before
// any write); then one pass over the kept rows writes both segments of each row with AVX-512
// (row_copy.h copy_two). Bytes beyond nope+rope are never touched. OpenMP above a payload threshold;
// when the buffer dwarfs the LLC and rows start on 64-byte lines, whole lines are assembled from
// the two sources and streamed (non-temporal), only a partial last line uses a regular masked store.
#include <tvm/ffi/function.h>

#include "jitkv/cpu/row_copy.h"
#include "jitkv/cpu/scatter.h"
#include "mla/set_mla_kv_buffer.cuh"

namespace jitkv {
namespace {

constexpr const char* kOp = "set_mla_kv_buffer";

void write_rows(const mla::MlaParams& a, const cpu::RowSlot* rows, int64_t m) {
  int64_t payload = m * (a.nope_bytes + a.rope_bytes);
  int threads = cpu::threads_for(payload);
  bool nt = cpu::want_streaming(a.num_slots * cpu::abs64(a.dst_row_stride), payload, threads) &&
            cpu::aligned64(a.dst) && a.dst_row_stride % 64 == 0;
  cpu::for_rows(m, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t r = rows[i].row;
      cpu::copy_two(a.dst + rows[i].slot * a.dst_row_stride, a.nope + r * a.nope_row_stride, a.nope_bytes,
                        a.rope + r * a.rope_row_stride, a.rope_bytes, nt);
    }
    if (nt) cpu::stream_fence();
  });
}

void set_mla_kv_buffer_cpu(TensorView kv_buffer, TensorView loc, TensorView k_nope, TensorView k_rope,
                           int64_t skip_slot) {
  if (kv_buffer.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << kOp << ": kv_buffer: expected a CPU tensor for the CPU kernel, got device_type "
                              << kv_buffer.device().device_type;
  }
  const mla::MlaParams a = mla::parse_params(kOp, kv_buffer, loc, k_nope, k_rope, skip_slot);
  if (a.n == 0) return;

  cpu::RowSlotBuffer buf(a.n);
  int64_t m = a.loc_i64 ? cpu::resolve_slots(kOp, "loc", static_cast<const int64_t*>(a.loc), a.n, a.skip_slot,
                                             nullptr, false, 0, a.num_slots, buf.data())
                        : cpu::resolve_slots(kOp, "loc", static_cast<const int32_t*>(a.loc), a.n, a.skip_slot,
                                             nullptr, false, 0, a.num_slots, buf.data());
  if (m == 0) return;
  write_rows(a, buf.data(), m);
}

}  // namespace
}  // namespace jitkv

TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_mla_kv_buffer, jitkv::set_mla_kv_buffer_cpu);
