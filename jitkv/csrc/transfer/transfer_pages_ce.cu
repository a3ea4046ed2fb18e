// tvm-ffi binding of transfer_pages' copy-engine path on CUDA: the page ids on the host, the pools a
// device pool and a pinned host pool (or two device pools of one GPU). No SM runs: the copies go to the
// GPU's copy engines, so an offload or a load overlaps the forward pass without taking its SMs.
//
// Algorithm: parse and check (parse.h), the pairs resolved on the host (plan.h: padding skipped, an id
// past its pool raises IndexError before anything is queued, the last pair of a destination page
// wins), then one run of page_bytes per (pair, layer), a run merged into the one before it when both
// its source and destination follow on (adjacent pages, or a page-first pool's layers), layer by
// layer unless both pools are page-first; a (K, V) tuple's two pool pairs both checked first, their
// runs in one list. The runs go to cudaMemcpyBatchAsync in batches of 16, 32, 64, then 128 runs
// (stream ordered; PreferOverlapWithCompute asks for the copy engines): the engines start on the
// first batch while the host submits the next (submit); a stream being captured into a graph (host ids
// take the SM kernel then, unless its module is missing), or a driver without the batch API, gets one
// cudaMemcpyAsync per run (memcpy nodes under capture), all on the caller's current stream (the batch
// on the per-thread default stream in place of the legacy one, which the batch API refuses: ordered
// the same, see submit). The batch API copies its descriptors before it returns, so the host vectors
// here may go.
#include <cuda_runtime.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "jitkv/check.h"
#include "jitkv/codes.h"
#include "jitkv/cuda/launch.cuh"
#include "transfer/host_pool.cuh"
#include "transfer/params.h"
#include "transfer/parse.h"
#include "transfer/plan.h"

namespace {

using namespace jitkv::transfer;
using jitkv::codes::Status;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;

constexpr const char* kOp = "transfer_pages";

struct Runs {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> bytes;

  void add(char* to, const char* from, size_t n) {
    if (!dst.empty() && static_cast<char*>(dst.back()) + bytes.back() == to &&
        static_cast<const char*>(src.back()) + bytes.back() == from) {
      bytes.back() += n;
      return;
    }
    dst.push_back(to);
    src.push_back(from);
    bytes.push_back(n);
  }
};

// The runs of one pool pair, added to `runs`.
void plan_runs(const TransferParams& p, const std::vector<PagePair>& pairs, Runs& runs) {
  if (p.num_layers == 0 || p.page_bytes == 0) return;
  const size_t n = static_cast<size_t>(p.page_bytes);
  auto run = [&](const PagePair& pair, int64_t layer) {
    runs.add(p.dst.at(layer, pair.dst), p.src.at(layer, pair.src), n);
  };
  const bool page_first = p.src.layer_stride == p.page_bytes && p.dst.layer_stride == p.page_bytes;
  if (page_first) {
    for (const PagePair& pair : pairs)
      for (int64_t l = 0; l < p.num_layers; ++l) run(pair, l);
  } else {
    for (int64_t l = 0; l < p.num_layers; ++l)
      for (const PagePair& pair : pairs) run(pair, l);
  }
}

void throw_cuda(const char* what, cudaError_t err) {
  cudaGetLastError();  // clear it: torch's next check would report it as its own
  TVM_FFI_THROW(RuntimeError) << kOp << ": " << what << " failed: " << cudaGetErrorString(err);
}

// Runs per cudaMemcpyBatchAsync call: the first call's, doubling up to the most (submit).
constexpr size_t kFirstBatch = 16, kMaxBatch = 128;

// captured: a graph is being captured on stream (where the batch API is refused).
void submit(Runs& runs, cudaStream_t stream, bool captured) {
  cudaError_t err = cudaSuccess;
  if (!captured) {
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t first = 0;
    // The batch API refuses the legacy default stream (torch's current stream unless the caller set
    // one). The per-thread default stream is a blocking stream: it waits for the legacy stream's
    // earlier work and the legacy stream's later work waits for it, so the copies keep their order.
    const bool legacy = stream == nullptr || stream == cudaStreamLegacy;
    cudaStream_t batch_stream = legacy ? cudaStreamPerThread : stream;
    // A call costs the host about 0.6 µs a run, and the engines start on its runs only once it has
    // returned: 2,048 runs of 128 KiB in one call moved at 0.78 of a contiguous copy on an H200, in
    // calls of up to 128 runs at 0.97 host to device (docs/performance.md "Copy-engine batches").
    // The first calls are small so that the engines start early.
    const size_t count = runs.dst.size();
    size_t done = 0;
    for (size_t batch = kFirstBatch; done < count; batch = std::min(2 * batch, kMaxBatch)) {
      const size_t n = std::min(batch, count - done);
      err = cudaMemcpyBatchAsync(runs.dst.data() + done, runs.src.data() + done, runs.bytes.data() + done, n, &attr,
                                 &first, 1, batch_stream);
      if (err != cudaSuccess) break;
      done += n;
    }
    if (err == cudaSuccess) return;
    if (done > 0 || (err != cudaErrorNotSupported && err != cudaErrorCallRequiresNewerDriver))
      throw_cuda("cudaMemcpyBatchAsync", err);
    cudaGetLastError();  // the driver lacks the batch API: one copy per run below
  }
  for (size_t k = 0; k < runs.dst.size(); ++k) {
    err = cudaMemcpyAsync(runs.dst[k], runs.src[k], runs.bytes[k], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) throw_cuda("cudaMemcpyAsync", err);
  }
}

// The devices, the pools and the id tensors checked, the call's parameters parsed; the ids' range and
// the host pools' memory are checked_pairs'. sname, dname: the pools' names in messages.
TransferParams checked_params(const TensorView& src, const TensorView& dst, const TensorView& src_pages,
                              const TensorView& dst_pages, DLDevice dev, const char* sname, const char* dname) {
  const DLDevice pools = host_ids_device(kOp, src, dst, src_pages, dst_pages, sname, dname);
  if (!jitkv::same_device(pools, dev)) {
    TVM_FFI_THROW(ValueError) << kOp << ": " << sname << ": expected the pools of a copy on " << jitkv::device_str(dev)
                              << ", got one on " << jitkv::device_str(pools);
  }
  return parse_params(kOp, src, dst, src_pages, dst_pages, sname, dname);
}

// The pairs of checked params p resolved, IndexError for an id past its pool, and its host pools
// checked pinned: the rest of the checks, before anything is copied.
std::vector<PagePair> checked_pairs(const TransferParams& p, const TensorView& src, const TensorView& dst, DLDevice dev,
                                    const char* sname, const char* dname) {
  std::vector<PagePair> pairs = resolve_pairs(kOp, p);
  check_host_pool(kOp, sname, src, dev, false);
  check_host_pool(kOp, dname, dst, dev, false);
  return pairs;
}

// One pool pair (src2 and dst2 None: two tensors fewer for tvm-ffi to convert on the engine's
// per-layer call, as transfer_pages_host_ids) or a (K, V) tuple (any page sizes): every pair checked
// and resolved before anything is queued, then all runs in one batch; returns codes::Status kDone.
// min_page_bytes > 0: pages the SM kernel takes instead (copy_engines_take: the smaller of a tuple's
// page sizes under min_page_bytes, or a graph being captured) get kSmKernel once the pools are
// checked, nothing copied; 0: every call is copied here (a forced or fallback call).
int64_t transfer_pages_ce(TensorView src, TensorView dst, Optional<TensorView> src2, Optional<TensorView> dst2,
                          TensorView src_pages, TensorView dst_pages, int64_t device, int64_t min_page_bytes) {
  const DLDevice dev{kDLCUDA, static_cast<int32_t>(device)};
  jitkv::cuda::DeviceGuard guard(dev.device_id);
  const bool two = second_pool_pair(kOp, src2, dst2);
  const char* sname = two ? "src[0]" : "src";
  const char* dname = two ? "dst[0]" : "dst";
  const TransferParams p = checked_params(src, dst, src_pages, dst_pages, dev, sname, dname);
  TransferParams q = p;
  if (two) q = checked_params(src2.value(), dst2.value(), src_pages, dst_pages, dev, "src[1]", "dst[1]");
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev.device_id));
  if (min_page_bytes > 0 && !copy_engines_take(kOp, std::min(p.page_bytes, q.page_bytes), min_page_bytes, stream)) {
    return static_cast<int64_t>(Status::kSmKernel);
  }
  // The stream asked once: copy_engines_take found no capture; a call copied here whatever (0) asks now.
  const bool captured = min_page_bytes == 0 && stream_capturing(kOp, stream);
  const std::vector<PagePair> pairs = checked_pairs(p, src, dst, dev, sname, dname);
  std::vector<PagePair> pairs2;
  if (two) pairs2 = checked_pairs(q, src2.value(), dst2.value(), dev, "src[1]", "dst[1]");
  Runs runs;
  plan_runs(p, pairs, runs);
  if (two) plan_runs(q, pairs2, runs);
  if (!runs.dst.empty()) submit(runs, stream, captured);
  return static_cast<int64_t>(Status::kDone);
}

// The checks alone (host ids whose pages go to the SM kernel: the ids are range checked here, on the
// host, where they are, rather than skipped on the device).
void transfer_pages_check(TensorView src, TensorView dst, TensorView src_pages, TensorView dst_pages, int64_t device) {
  const DLDevice dev{kDLCUDA, static_cast<int32_t>(device)};
  jitkv::cuda::DeviceGuard guard(dev.device_id);
  checked_pairs(checked_params(src, dst, src_pages, dst_pages, dev, "src", "dst"), src, dst, dev, "src", "dst");
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(transfer_pages_ce, transfer_pages_ce);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(transfer_pages_check, transfer_pages_check);
