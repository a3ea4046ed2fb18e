// transfer_pages' argument parser (parse_params: every check but the devices, which each binding checks
// against its own rule; cuda_device: the CUDA binding's rule), with errors naming the argument as
// jitkv/ops/transfer.py's check does, and the call's parameter block (params.h).
#pragma once

#include <tvm/ffi/optional.h>

#include <cstdint>
#include <sstream>
#include <string>

#include "jitkv/check.h"
#include "transfer/params.h"

namespace jitkv::transfer {

namespace detail {

// Bytes of one page, after checking the pool is [num_layers, num_pages, *page] with a dense page part.
inline int64_t page_bytes(const char* op, const char* name, const TensorView& t) {
  if (t.ndim() < 2) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a pool [num_layers, num_pages, *page], got shape "
                              << shape_str(t);
  }
  int64_t want = 1;
  for (int d = t.ndim() - 1; d >= 2; --d) {
    if (t.size(d) != 1 && t.stride(d) != want) {
      TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a dense page part (every dim after dim 1 "
                                << "contiguous), got shape " << shape_str(t) << " with stride " << t.stride(d)
                                << " at dim " << d;
    }
    want *= t.size(d);
  }
  return want * elem_bytes(t.dtype());
}

// "[16, 8, 128]": dims 2.. of a pool (Python's list spelling, as the Python check prints it).
inline std::string page_shape(const TensorView& t) {
  std::ostringstream os;
  os << "[";
  for (int d = 2; d < t.ndim(); ++d) os << (d > 2 ? ", " : "") << t.size(d);
  os << "]";
  return os.str();
}

inline Pool pool(const TensorView& t) {
  const int64_t es = elem_bytes(t.dtype());
  return Pool{data_ptr(t), t.stride(0) * es, t.stride(1) * es, t.size(1)};
}

}  // namespace detail

inline TransferParams parse_params(const char* op, const TensorView& src, const TensorView& dst,
                                   const TensorView& src_pages, const TensorView& dst_pages, const char* sname = "src",
                                   const char* dname = "dst") {
  const int64_t bytes = detail::page_bytes(op, sname, src);
  detail::page_bytes(op, dname, dst);
  bool same_pages = src.ndim() == dst.ndim();
  for (int d = 2; same_pages && d < src.ndim(); ++d) same_pages = src.size(d) == dst.size(d);
  if (src.dtype() != dst.dtype() || !same_pages) {
    TVM_FFI_THROW(ValueError) << op << ": " << dname << ": expected dtype " << src.dtype() << " and page shape "
                              << detail::page_shape(src) << " like " << sname << ", got " << dst.dtype() << " and "
                              << detail::page_shape(dst);
  }
  if (src.size(0) != dst.size(0)) {
    TVM_FFI_THROW(ValueError) << op << ": " << dname << ": expected " << src.size(0) << " layers like " << sname
                              << ", got " << dst.size(0);
  }
  check_written(op, dname, dst);
  const bool src_i64 = check_index(op, "src_pages", src_pages);
  const bool dst_i64 = check_index(op, "dst_pages", dst_pages);
  if (dst_pages.size(0) != src_pages.size(0)) {
    TVM_FFI_THROW(ValueError) << op << ": dst_pages: expected " << src_pages.size(0) << " entries like src_pages, got "
                              << dst_pages.size(0);
  }
  TransferParams p;
  p.src = detail::pool(src);
  p.dst = detail::pool(dst);
  p.src2 = p.src;
  p.dst2 = p.dst;
  p.num_pools = 1;
  p.src_pages = data_ptr(src_pages);
  p.dst_pages = data_ptr(dst_pages);
  p.n = src_pages.size(0);
  p.num_layers = src.size(0);
  p.page_bytes = bytes;  // dst's too: same dtype, same page shape
  p.src_i64 = src_i64;
  p.dst_i64 = dst_i64;
  return p;
}

// The CUDA binding's device rule (jitkv/ops/transfer.py _devices): the ids on a CUDA device; each pool
// on that device or a host pool (kDLCPU, or kDLCUDAHost), not both on the host. Returns the ids' device.
// Whether a host pool is pinned (page-locked, mapped for the device) the binding asks CUDA.
inline bool is_host(const TensorView& t) {
  return t.device().device_type == kDLCPU || t.device().device_type == kDLCUDAHost;
}

inline DLDevice cuda_device(const char* op, const TensorView& src, const TensorView& dst, const TensorView& src_pages,
                            const TensorView& dst_pages, const char* sname = "src", const char* dname = "dst") {
  const DLDevice dev = src_pages.device();
  if (dev.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << op << ": src_pages: expected a CUDA tensor for the CUDA kernel, got one on "
                              << device_str(dev);
  }
  check_device(op, "dst_pages", dst_pages, dev, "src_pages");
  if (is_host(src) && is_host(dst)) {
    TVM_FFI_THROW(ValueError) << op << ": src_pages: expected a tensor on cpu like " << sname << " and " << dname
                              << " (a host-to-host transfer), got one on " << device_str(dev);
  }
  if (!is_host(src)) check_device(op, sname, src, dev, "src_pages");
  if (!is_host(dst)) check_device(op, dname, dst, dev, "src_pages");
  return dev;
}

// A (K, V) tuple's second pool pair: src[1] and dst[1] both given, or neither (one pool pair).
inline bool second_pool_pair(const char* op, const tvm::ffi::Optional<TensorView>& src2,
                             const tvm::ffi::Optional<TensorView>& dst2) {
  if (src2.has_value() != dst2.has_value()) {
    TVM_FFI_THROW(ValueError) << op << ": " << (src2.has_value() ? "dst[1]" : "src[1]") << ": expected a pool like "
                              << (src2.has_value() ? "src[1]" : "dst[1]") << ", got None";
  }
  return src2.has_value();
}

// The device rule of host ids beside a GPU (the copy-engine path, and the SM kernel with the ids in its
// parameter block): the ids on the host; not both pools on the host; the CUDA pools on one GPU, which
// the call returns (the first CUDA pool's), the others host pools.
inline DLDevice host_ids_device(const char* op, const TensorView& src, const TensorView& dst,
                                const TensorView& src_pages, const TensorView& dst_pages, const char* sname = "src",
                                const char* dname = "dst") {
  if (!is_host(src_pages)) {
    TVM_FFI_THROW(ValueError) << op << ": src_pages: expected a CPU tensor (host ids), got one on "
                              << device_str(src_pages.device());
  }
  if (!is_host(dst_pages)) {
    TVM_FFI_THROW(ValueError) << op << ": dst_pages: expected a CPU tensor like src_pages, got one on "
                              << device_str(dst_pages.device());
  }
  if (is_host(src) && is_host(dst)) {
    TVM_FFI_THROW(ValueError) << op << ": " << sname << ": expected a pool on a GPU beside the host pool " << dname
                              << ", got both on the host";
  }
  const DLDevice dev = is_host(src) ? dst.device() : src.device();
  if (!is_host(dst)) check_device(op, dname, dst, dev, sname);
  return dev;
}

}  // namespace jitkv::transfer
