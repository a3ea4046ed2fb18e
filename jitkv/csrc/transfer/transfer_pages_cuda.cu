// tvm-ffi binding of transfer_pages on CUDA: parses and checks the arguments (parse.h: parse_params, and
// cuda_device's device rule), checks every host pool is pinned and mapped at its own address (UVA),
// checks the views against the module's vector width, and launches the SM copy kernel (kernels.cuh) on
// the caller's current stream of the ids' device (jitkv/cuda/launch.cuh: device guard, and PDL from
// sm_90 as every jitkv kernel: the kernel waits for the previous grid before its first access). Ids on
// the GPU: transfer_pages, transfer_pages_pair (a (K, V) tuple in one launch); ids on the host:
// transfer_pages_host_ids, the pairs resolved on the host and passed in the launch's parameter block.
// The two tuple bindings and the host-ids one return a codes::Status: kDone, or, having copied
// nothing, kPerPool for a tuple whose pools differ in page size or layer count (one launch cannot move
// them) and kCopyEngines for host ids of pages the copy engines take (the Python side then calls the
// copy-engine module): the engine's per-layer call decides with no Python reading a shape.
//
// The kernel's vectors: 16 bytes when every data pointer, layer and page stride and the page bytes
// are multiples of 16, else 4 when they are of 4, else 1 (vector_bytes); all three instantiations
// (for GPU ids and each of the three parameter blocks of host ids) live in this one module, so the
// host chooses per call at the cost of an OR, not a module per width.
//
// The grid is bounded: max_sms (at most the device's SMs; 0: kLinkSms for a copy with a host pool,
// every SM for one inside the GPU) x kCtasPerSm CTAs of kWarps warps, fewer when there are fewer
// chunk pairs than warps; the kernel's grid-stride loop takes the rest. The bound exists because a
// host<->device copy runs beside the forward pass (a HiCache load or offload overlapping compute): it
// must not take the SMs the model's kernels need, and it is bound by the link, which a few SMs' loads
// in flight saturate (kWarps x kCtasPerSm warps per SM, each lane 2 x kUnroll 16-byte vectors: 128 KiB
// per SM in flight). A copy inside the GPU (a pack for a handoff) is bound by HBM and needs every SM.
// No host sync: ids past their pools are skipped on the device.
#include <cuda_runtime.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "jitkv/check.h"
#include "jitkv/cuda/launch.cuh"
#include "transfer/host_pool.cuh"
#include "transfer/kernels.cuh"
#include "transfer/params.h"
#include "transfer/parse.h"
#include "transfer/plan.h"

namespace {

using namespace jitkv::transfer;
using jitkv::codes::Status;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;

constexpr const char* kOp = "transfer_pages";

int64_t status(Status s) { return static_cast<int64_t>(s); }

uint64_t u(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); }
uint64_t u(int64_t x) { return static_cast<uint64_t>(x); }

// The widest vector (16, 4 or 1 bytes) dividing every base, stride and the page bytes (module comment).
int vector_bytes(const TransferParams& p) {
  uint64_t bits = u(p.page_bytes);
  for (const Pool* pool : {&p.src, &p.dst, &p.src2, &p.dst2}) {
    bits |= u(pool->base) | u(pool->layer_stride) | u(pool->page_stride);
  }
  return bits % 16 == 0 ? 16 : bits % 4 == 0 ? 4 : 1;
}

// The grid (module comment) and the launch on the caller's current stream of `dev`; `ids` holds the
// pairs when kInline > 0 (p.n of them), else the kernel reads p's id tensors.
template <int kVec, int kInline>
void launch_vec(const TransferParams& p, const InlineIds<kInline>& ids, DLDevice dev, bool with_host, int64_t max_sms) {
  const int64_t runs = p.n * p.num_layers * p.num_pools;
  const int64_t chunks = runs * ((p.page_bytes / kVec + kChunk - 1) / kChunk);
  if (chunks >= (int64_t{1} << 31) || p.page_bytes / kVec >= (int64_t{1} << 31)) {
    TVM_FFI_THROW(ValueError) << kOp << ": src_pages: " << p.n << " pages of " << p.num_layers << " layers of "
                              << p.page_bytes << " bytes are more than one call of the kernel moves (2^31 chunks "
                              << "of " << kChunk << " vectors); split the call";
  }
  if (chunks == 0) return;
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(dev.device_id);
  const int64_t all = std::max(info.sms, 1);
  const int64_t sms = std::min<int64_t>(max_sms > 0 ? max_sms : (with_host ? kLinkSms : all), all);
  const int64_t blocks = std::min<int64_t>(sms * kCtasPerSm, ((chunks + 1) / 2 + kWarps - 1) / kWarps);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev.device_id));
  const cudaError_t err = jitkv::cuda::launch(transfer_pages_kernel<kVec, kInline>, dim3(static_cast<unsigned>(blocks)),
                                              dim3(kWarps * 32), stream, info.pdl(), p, ids);
  jitkv::cuda::check_launch(kOp, err);
}

template <int kInline>
void launch(const TransferParams& p, const InlineIds<kInline>& ids, DLDevice dev, bool with_host, int64_t max_sms) {
  if (max_sms < 0) {
    TVM_FFI_THROW(ValueError) << kOp << ": max_sms: expected an int >= 1 (or 0: the default), got " << max_sms;
  }
  switch (vector_bytes(p)) {
    case 16:
      return launch_vec<16>(p, ids, dev, with_host, max_sms);
    case 4:
      return launch_vec<4>(p, ids, dev, with_host, max_sms);
    default:
      return launch_vec<1>(p, ids, dev, with_host, max_sms);
  }
}

void launch(const TransferParams& p, DLDevice dev, bool with_host, int64_t max_sms) {
  launch(p, InlineIds<0>{}, dev, with_host, max_sms);
}

// A (K, V) tuple's second pool pair moves in the first's launch only with its page size and layer count.
bool same_geometry(const TransferParams& p, const TransferParams& q) {
  return q.page_bytes == p.page_bytes && q.num_layers == p.num_layers;
}

void transfer_pages(TensorView src, TensorView dst, TensorView src_pages, TensorView dst_pages, int64_t max_sms) {
  const DLDevice dev = cuda_device(kOp, src, dst, src_pages, dst_pages);
  const TransferParams p = parse_params(kOp, src, dst, src_pages, dst_pages);
  jitkv::cuda::DeviceGuard guard(dev.device_id);
  check_host_pool(kOp, "src", src, dev, true);
  check_host_pool(kOp, "dst", dst, dev, true);
  launch(p, dev, is_host(src) || is_host(dst), max_sms);
}

// A (K, V) tuple in one launch: two pool pairs of one page size and layer count (else kPerPool), every
// argument checked before anything is copied.
int64_t transfer_pages_pair(TensorView src, TensorView dst, TensorView src2, TensorView dst2, TensorView src_pages,
                            TensorView dst_pages, int64_t max_sms) {
  const DLDevice dev = cuda_device(kOp, src, dst, src_pages, dst_pages, "src[0]", "dst[0]");
  cuda_device(kOp, src2, dst2, src_pages, dst_pages, "src[1]", "dst[1]");
  TransferParams p = parse_params(kOp, src, dst, src_pages, dst_pages, "src[0]", "dst[0]");
  const TransferParams q = parse_params(kOp, src2, dst2, src_pages, dst_pages, "src[1]", "dst[1]");
  if (!same_geometry(p, q)) return status(Status::kPerPool);
  p.src2 = q.src;
  p.dst2 = q.dst;
  p.num_pools = 2;
  jitkv::cuda::DeviceGuard guard(dev.device_id);
  check_host_pool(kOp, "src[0]", src, dev, true);
  check_host_pool(kOp, "dst[0]", dst, dev, true);
  check_host_pool(kOp, "src[1]", src2, dev, true);
  check_host_pool(kOp, "dst[1]", dst2, dev, true);
  launch(p, dev, is_host(src) || is_host(dst) || is_host(src2) || is_host(dst2), max_sms);
  return status(Status::kDone);
}

// `count` resolved pairs from `first` in one launch whose parameter block holds kInline of them.
template <int kInline>
void launch_pairs(TransferParams p, const std::vector<PagePair>& pairs, size_t first, size_t count, DLDevice dev,
                  bool with_host, int64_t max_sms) {
  InlineIds<kInline> ids;
  for (size_t k = 0; k < count; ++k) {
    ids.src[k] = static_cast<int32_t>(pairs[first + k].src);
    ids.dst[k] = static_cast<int32_t>(pairs[first + k].dst);
  }
  p.n = static_cast<int64_t>(count);
  launch(p, ids, dev, with_host, max_sms);
}

// The smallest parameter block that holds the pairs (the host copies the whole block per launch: a
// 31.25 KiB one costs it microseconds more than a 512-byte one); more than kInlinePairs, launches of
// kInlinePairs, each waiting for the one before it to end (about 2 µs of the link idle between them
// on an H200: docs/performance.md "Host ids in the parameter block").
void launch_inline(const TransferParams& p, const std::vector<PagePair>& pairs, DLDevice dev, bool with_host,
                   int64_t max_sms) {
  const size_t n = pairs.size();
  if (n <= static_cast<size_t>(kInlineSmall))
    return launch_pairs<kInlineSmall>(p, pairs, 0, n, dev, with_host, max_sms);
  if (n <= static_cast<size_t>(kInlineMid)) return launch_pairs<kInlineMid>(p, pairs, 0, n, dev, with_host, max_sms);
  for (size_t first = 0; first < n; first += kInlinePairs) {
    const size_t count = std::min(n - first, static_cast<size_t>(kInlinePairs));
    launch_pairs<kInlinePairs>(p, pairs, first, count, dev, with_host, max_sms);
  }
}

// Ids on the host (an engine's CPU-side plan, as vLLM's block_mapping) for one pool pair (src2 and dst2
// None: two tensors fewer for tvm-ffi to convert on the engine's per-layer call) or a (K, V) tuple:
// every argument checked; pages the copy engines take (copy_engines_take, the smaller of a tuple's two
// page sizes) kCopyEngines, a tuple of two page sizes or layer counts kPerPool, both before anything
// is copied; else the pairs resolved as the copy-engine path resolves them (plan.h: padding skipped,
// IndexError for an id past its pool before anything is copied, the last pair of a destination page
// wins), then the SM kernel with the pairs in its parameter block (launch_inline): no id is staged or
// copied, and a captured graph keeps the pairs of the capture.
int64_t transfer_pages_host_ids(TensorView src, TensorView dst, Optional<TensorView> src2, Optional<TensorView> dst2,
                                TensorView src_pages, TensorView dst_pages, int64_t max_sms,
                                int64_t ce_min_page_bytes) {
  const bool two = second_pool_pair(kOp, src2, dst2);
  const char* sname = two ? "src[0]" : "src";
  const char* dname = two ? "dst[0]" : "dst";
  const DLDevice dev = host_ids_device(kOp, src, dst, src_pages, dst_pages, sname, dname);
  TransferParams p = parse_params(kOp, src, dst, src_pages, dst_pages, sname, dname);
  TransferParams q = p;
  TensorView s2 = src, d2 = dst;  // the second pool pair where two
  if (two) {
    s2 = src2.value();
    d2 = dst2.value();
    host_ids_device(kOp, s2, d2, src_pages, dst_pages, "src[1]", "dst[1]");
    if (!is_host(s2)) jitkv::check_device(kOp, "src[1]", s2, dev, sname);
    if (!is_host(d2)) jitkv::check_device(kOp, "dst[1]", d2, dev, sname);
    q = parse_params(kOp, s2, d2, src_pages, dst_pages, "src[1]", "dst[1]");
  }
  jitkv::cuda::DeviceGuard guard(dev.device_id);
  const auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev.device_id));
  if (copy_engines_take(kOp, std::min(p.page_bytes, q.page_bytes), ce_min_page_bytes, stream)) {
    return status(Status::kCopyEngines);
  }
  if (!same_geometry(p, q)) return status(Status::kPerPool);
  for (const TransferParams* t : {&p, &q}) {
    if (t->src.num_pages > INT32_MAX || t->dst.num_pages > INT32_MAX) {
      TVM_FFI_THROW(ValueError) << kOp << ": src_pages: ids on the host take pools of fewer than 2^31 pages, got "
                                << t->src.num_pages << " and " << t->dst.num_pages << "; pass the ids on the GPU";
    }
  }
  // The pairs are p's; q's plan only range checks the ids against the second pools, so it runs only
  // where one of them has fewer pages than its counterpart in p (else p's plan has checked them).
  const std::vector<PagePair> pairs = resolve_pairs(kOp, p);
  if (two && (q.src.num_pages < p.src.num_pages || q.dst.num_pages < p.dst.num_pages)) resolve_pairs(kOp, q);
  check_host_pool(kOp, sname, src, dev, true);
  check_host_pool(kOp, dname, dst, dev, true);
  bool with_host = is_host(src) || is_host(dst);
  if (two) {
    check_host_pool(kOp, "src[1]", s2, dev, true);
    check_host_pool(kOp, "dst[1]", d2, dev, true);
    with_host = with_host || is_host(s2) || is_host(d2);
    p.src2 = q.src;
    p.dst2 = q.dst;
    p.num_pools = 2;
  }
  launch_inline(p, pairs, dev, with_host, max_sms);
  return status(Status::kDone);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(transfer_pages, transfer_pages);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(transfer_pages_pair, transfer_pages_pair);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(transfer_pages_host_ids, transfer_pages_host_ids);
