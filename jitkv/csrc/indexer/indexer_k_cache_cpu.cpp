// The indexer K cache ops on CPU (docs/design.md §5.1).
//
// Writer: parse and check (indexer_k_cache.cuh, its host part); resolve every slot serially (slot < 0
// skipped, IndexError for an out-of-range slot before anything is written); then per kept token: the
// amax of its values (cpu/fp8.h's abs_max: NaN left out, inf kept), the scale, the values through
// Fp8Quantizer (x / scale, clamp, round to nearest even: torch's bytes; AVX-512 or AVX2 where built)
// and the scale's 4 bytes. OpenMP above a payload threshold, the values streamed where their lines are
// cold (cpu/scatter.h).
// Gather: per dst row, the covering request (binary search over cu_seq_lens), its block-table entry,
// then a copy of the token's value and scale bytes (zeros for an invalid block).
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstring>

#include "indexer/params.h"
#include "indexer/parse.h"
#include "jitkv/cpu/fp8.h"
#include "jitkv/cpu/isa.h"
#include "jitkv/cpu/scatter.h"

namespace jitkv {
namespace {

using namespace indexer;

constexpr const char* kWriteOp = "indexer_k_quant_and_cache";
constexpr const char* kGatherOp = "gather_indexer_k_quant_cache";

void check_cpu(const char* op, const TensorView& kv_cache) {
  if (kv_cache.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << op << ": kv_cache: expected a CPU tensor for the CPU kernel, got "
                              << device_str(kv_cache.device());
  }
}

// The scale of one token of kHeadDim bf16 / fp16 values (see indexer_k_cache.cuh).
float token_scale(const uint16_t* x, bool f16, bool ue8m0) {
  const float amax = cpu::abs_max(f16 ? cpu::SrcKind::kF16 : cpu::SrcKind::kBF16, x, kHeadDim);
  const float scale = std::max(amax, kAmaxMin) / kFp8Max;
  return ue8m0 ? cpu::f32_from_bits((cpu::f32_bits(scale) + 0x7FFFFFu) & 0x7F800000u) : scale;
}

// Streaming stores for a token's values (two whole lines where the cache and its blocks start on lines)
// when the written lines are cold (cpu::want_streaming); the 4-byte scales are plain stores.
bool streamed(const WriteParams& p, int64_t m, int threads) {
  return cpu::aligned64(p.cache) && p.block_stride % 64 == 0 &&
         cpu::want_streaming(p.num_slots / p.block_size * p.block_stride, m * kTokenBytes, threads);
}

void write_rows(const WriteParams& p, const cpu::RowSlot* rows, int64_t m) {
  const cpu::SrcKind kind = p.k_f16 ? cpu::SrcKind::kF16 : cpu::SrcKind::kBF16;
  const int threads = cpu::threads_for(m * (2 * kHeadDim + kTokenBytes));
  const bool nt = streamed(p, m, threads);
  cpu::for_rows(m, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const char* src = p.k + rows[i].row * p.k_row_stride;
      const int64_t blk = rows[i].slot / p.block_size, pos = rows[i].slot - blk * p.block_size;
      char* block = p.cache + blk * p.block_stride;
      const float scale = token_scale(reinterpret_cast<const uint16_t*>(src), p.k_f16, p.ue8m0);
      // Two whole lines by the token's own scale: segments takes the inlined line loop (no call).
      const cpu::Fp8Quantizer q(cpu::kFp8E4M3, scale);
      cpu::Fp8Quantizer::segments(&q, 0, reinterpret_cast<uint8_t*>(block + pos * kHeadDim), 0, kind, src, 0, 1,
                                  kHeadDim, nt);
      std::memcpy(block + p.block_size * kHeadDim + pos * kScaleBytes, &scale, kScaleBytes);
    }
    if (nt) cpu::stream_fence();
  });
}

void indexer_k_quant_and_cache_cpu(TensorView k, TensorView kv_cache, TensorView slot_mapping, int64_t block_size,
                                   int64_t scale_fmt) {
  check_cpu(kWriteOp, kv_cache);
  const WriteParams p = parse_write(kWriteOp, k, kv_cache, slot_mapping, block_size, scale_fmt);
  if (p.n == 0) return;
  cpu::RowSlotBuffer buf(p.n);
  const int64_t m = p.slot_i64 ? cpu::resolve_slots(kWriteOp, "slot_mapping", static_cast<const int64_t*>(p.slots), p.n,
                                                    -1, nullptr, false, 0, p.num_slots, buf.data())
                               : cpu::resolve_slots(kWriteOp, "slot_mapping", static_cast<const int32_t*>(p.slots), p.n,
                                                    -1, nullptr, false, 0, p.num_slots, buf.data());
  if (m > 0) write_rows(p, buf.data(), m);
}

void gather_indexer_k_quant_cache_cpu(TensorView kv_cache, TensorView dst_k, TensorView dst_scale,
                                      TensorView block_table, TensorView cu_seq_lens, int64_t block_size) {
  check_cpu(kGatherOp, kv_cache);
  const GatherParams p = parse_gather(kGatherOp, kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size);
  if (p.num_tokens == 0 || p.batch == 0) return;
  const int threads = cpu::threads_for(p.num_tokens * 2 * kTokenBytes);
  cpu::for_rows(p.num_tokens, threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t start;
      const int64_t b =
          request_of(t, p.batch, [&](int64_t i) { return static_cast<int64_t>(p.cu_seq_lens[i]); }, start);
      if (b < 0) continue;
      const int64_t i = t - start, j = i / p.block_size;
      const int64_t phys = j < p.max_blocks ? p.block_table[b * p.bt_row_stride + j] : -1;
      char* dk = p.dst_k + t * p.dst_k_stride;
      char* ds = p.dst_scale + t * p.dst_scale_stride;
      if (phys >= 0 && phys < p.num_blocks) {
        const char* block = p.cache + phys * p.block_stride;
        const int64_t pos = i - j * p.block_size;
        std::memcpy(dk, block + pos * kHeadDim, kHeadDim);
        std::memcpy(ds, block + p.block_size * kHeadDim + pos * kScaleBytes, kScaleBytes);
      } else {
        std::memset(dk, 0, kHeadDim);
        std::memset(ds, 0, kScaleBytes);
      }
    }
  });
}

}  // namespace
}  // namespace jitkv

TVM_FFI_DLL_EXPORT_TYPED_FUNC(indexer_k_quant_and_cache, jitkv::indexer_k_quant_and_cache_cpu);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gather_indexer_k_quant_cache, jitkv::gather_indexer_k_quant_cache_cpu);
JITKV_CPU_EXPORT_INFO();
