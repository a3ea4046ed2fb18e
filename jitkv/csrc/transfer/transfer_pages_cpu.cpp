// transfer_pages on CPU (host pool to host pool): page src_pages[i] of every layer of src is copied to
// page dst_pages[i] of dst (params.h).
//
// Algorithm: parse + validate (parse.h); one serial pass over the pairs (plan.h resolve_pairs: the id
// rules of docs/design.md §3, the last pair of each destination page); then the (pair, layer) runs
// are copied, page_bytes each (row_copy.h), OpenMP over the runs above a payload threshold (scatter.h
// threads_for). Streaming stores where every destination
// page starts on a 64-byte line and scatter.h want_streaming says the written lines are cold (a pool
// far larger than the LLC, or a large payload per thread); regular stores otherwise, pages of odd widths
// included. Re-measure with `python -m jitkv.benchmark --device cpu --op transfer`.
#include <tvm/ffi/function.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "jitkv/cpu/isa.h"
#include "jitkv/cpu/row_copy.h"
#include "jitkv/cpu/scatter.h"
#include "transfer/params.h"
#include "transfer/parse.h"
#include "transfer/plan.h"

namespace jitkv {
namespace {

using namespace transfer;

constexpr const char* kOp = "transfer_pages";

// Every page of the pool starts on a 64-byte line (what streaming stores need).
bool lines_aligned(const Pool& pool) {
  return reinterpret_cast<uintptr_t>(pool.base) % 64 == 0 && pool.layer_stride % 64 == 0 && pool.page_stride % 64 == 0;
}

// The bytes the pool spans (its pages of every layer), what decides whether its lines are cold.
int64_t span_bytes(const Pool& pool, int64_t layers) {
  return cpu::abs64(pool.layer_stride) * layers + cpu::abs64(pool.page_stride) * pool.num_pages;
}

void transfer_pages_cpu(TensorView src, TensorView dst, TensorView src_pages, TensorView dst_pages) {
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"src", &src},
                         {"dst", &dst},
                         {"src_pages", &src_pages},
                         {"dst_pages", &dst_pages}}) {
    if (t->device().device_type != kDLCPU) {
      TVM_FFI_THROW(ValueError) << kOp << ": " << name << ": expected a CPU tensor for the CPU kernel, got "
                                << device_str(t->device());
    }
  }
  const TransferParams p = parse_params(kOp, src, dst, src_pages, dst_pages);
  const std::vector<PagePair> pairs = resolve_pairs(kOp, p);
  const int64_t runs = static_cast<int64_t>(pairs.size()) * p.num_layers;
  if (runs == 0 || p.page_bytes == 0) return;
  const int64_t payload = runs * p.page_bytes;
  const int threads = cpu::threads_for(payload);
  const bool nt = lines_aligned(p.dst) && cpu::want_streaming(span_bytes(p.dst, p.num_layers), payload, threads);
  const int64_t layers = p.num_layers;
  cpu::for_rows(runs, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const PagePair& pair = pairs[static_cast<size_t>(r / layers)];
      const int64_t layer = r % layers;
      cpu::copy_seg(p.dst.at(layer, pair.dst), p.src.at(layer, pair.src), p.page_bytes, nt);
    }
    if (nt) cpu::stream_fence();
  });
}

}  // namespace
}  // namespace jitkv

TVM_FFI_DLL_EXPORT_TYPED_FUNC(transfer_pages, jitkv::transfer_pages_cpu);
JITKV_CPU_EXPORT_INFO();
