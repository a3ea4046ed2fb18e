// gather_mla_cache on CPU: out[t] = the cache entry of output row t (gather_mla_cache.cuh), copied or
// dequantized to bf16.
//
// Algorithm: parse + validate (gather_mla_cache.cuh, its host part); check cu_seq_lens serially
// (non-decreasing, rows inside out: ValueError before any write, as the reference does
// on CPU); then one pass over the output rows, OpenMP above a payload threshold: each row finds its
// entry with the same rule as the CUDA kernel (entry_offset) and is copied (row_copy.h) or
// dequantized (cpu/dequant.h: fp8 -> fp32 exactly, times the scale in fp32, rounded to bf16 nearest
// even, NaN as 0x7FFF; AVX-512 or AVX2 vectors where built, else a 256-entry table).
#include <tvm/ffi/function.h>

#include <cstring>

#include "jitkv/cpu/dequant.h"
#include "jitkv/cpu/isa.h"
#include "jitkv/cpu/row_copy.h"
#include "jitkv/cpu/scatter.h"
#include "mla_gather/entry.h"
#include "mla_gather/params.h"
#include "mla_gather/parse.h"

namespace jitkv {
namespace {

using namespace mla_gather;

constexpr const char* kOp = "gather_mla_cache";

void write_row(const GatherParams& p, char* dst, int64_t off, const float* table, float scale) {
  if (off < 0) {
    std::memset(dst, 0, static_cast<size_t>(p.out_row_bytes));
    return;
  }
  const char* src = p.cache + off;
  auto* d = reinterpret_cast<uint16_t*>(dst);
  const auto* s = reinterpret_cast<const uint8_t*>(src);
  switch (p.format) {
    case KvFormat::kCopy:
      cpu::copy_seg(dst, src, p.out_row_bytes, false);
      break;
    case KvFormat::kDsMla:
      for (int t = 0; t < DsMla::kNope / DsMla::kTile; ++t) {
        float tile_scale;
        std::memcpy(&tile_scale, src + DsMla::kScaleOffset + 4 * t, 4);
        cpu::dequant(d + t * DsMla::kTile, s + t * DsMla::kTile, DsMla::kTile, KvFormat::kE4M3, table, tile_scale);
      }
      std::memcpy(d + DsMla::kNope, src + DsMla::kRopeOffset, 2 * DsMla::kRope);
      break;
    default:
      cpu::dequant(d, s, p.out_row_bytes / 2, p.format, table, scale);
  }
}

// cu_seq_lens must describe rows of out (the strict check of reference.check_gather_rows): ValueError.
void check_rows(const GatherParams& p) {
  int64_t prev = 0;
  for (int64_t r = 0; r <= p.num_reqs; ++r) {
    const int64_t v = load_index(p.cu_seq_lens, r, p.cu_i64);
    if (r > 0 && v < prev) {
      TVM_FFI_THROW(ValueError) << kOp << ": cu_seq_lens: expected non-decreasing values, got " << prev << " then " << v
                                << " at positions " << r - 1 << ", " << r;
    }
    prev = v;
  }
  const int64_t first = load_index(p.cu_seq_lens, 0, p.cu_i64);
  if (first < 0) {
    TVM_FFI_THROW(ValueError) << kOp << ": cu_seq_lens: request 0 starts at row " << first << ", below row 0 of out";
  }
  if (prev > p.rows) {
    TVM_FFI_THROW(ValueError) << kOp << ": out: has " << p.rows << " rows, but the requests end at row " << prev
                              << " (cu_seq_lens[-1])";
  }
}

void gather_mla_cache_cpu(TensorView out, TensorView kv_cache, TensorView block_table, TensorView cu_seq_lens,
                          Optional<TensorView> seq_starts, int64_t format, Optional<TensorView> scale,
                          double scale_value) {
  if (out.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << kOp << ": out: expected a CPU tensor for the CPU kernel, got "
                              << device_str(out.device());
  }
  const GatherParams p =
      parse_params(kOp, out, kv_cache, block_table, cu_seq_lens, seq_starts, format, scale, scale_value);
  check_rows(p);
  if (p.rows == 0 || p.num_reqs == 0) return;
  const float s = p.scale_ptr ? *p.scale_ptr : p.scale_value;  // checked by the parse (check_host_scale)
  static const cpu::Fp8Table e4m3(KvFormat::kE4M3), e5m2(KvFormat::kE5M2);
  const float* table = (p.format == KvFormat::kE5M2 ? e5m2 : e4m3).v;
  const int threads = cpu::threads_for(p.rows * p.out_row_bytes);
  cpu::for_rows(p.rows, threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t off = entry_offset(p, t);
      if (off != kNotWritten) write_row(p, p.out + t * p.out_row_stride, off, table, s);
    }
  });
}

}  // namespace
}  // namespace jitkv

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gather_mla_cache, jitkv::gather_mla_cache_cpu);
JITKV_CPU_EXPORT_INFO();
