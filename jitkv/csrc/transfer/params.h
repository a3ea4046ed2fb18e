// transfer_pages' parameter block, shared by host and device: page src_pages[i] of every layer of
// the src pool is copied to page dst_pages[i] of the dst pool. A pool is [num_layers, num_pages,
// *page] with a dense page part, so one page of one layer is one run of page_bytes bytes at
// base + layer * layer_stride + page * page_stride (any strides: layer-first, or a page-first pool
// passed as its transpose(0, 1)).
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>

#include "jitkv/host_device.h"

namespace jitkv::transfer {

struct Pool {
  char* base;
  int64_t layer_stride;  // bytes
  int64_t page_stride;   // bytes
  int64_t num_pages;

  // The first byte of page `page` of layer `layer`: the one run every copy path moves.
  JITKV_HOST_DEVICE char* at(int64_t layer, int64_t page) const {
    return base + layer * layer_stride + page * page_stride;
  }
};

// A call moves one pool pair, or (the CUDA kernel, a (K, V) tuple in one launch) two of one page size
// and layer count: src2 / dst2, with num_pools 2.
struct TransferParams {
  Pool src, dst;
  Pool src2, dst2;  // num_pools == 2 only
  int num_pools;
  const void* src_pages;
  const void* dst_pages;
  int64_t n;  // entries of src_pages and dst_pages
  int64_t num_layers;
  int64_t page_bytes;
  bool src_i64, dst_i64;
};

// Page ids carried in a launch's parameter block: pairs of ids that were on the host (an engine's
// CPU-side plan), resolved there, kInline pairs at most per launch, so that nothing is staged or
// copied to the GPU before the kernel and a captured graph keeps the ids it was captured with. int32:
// the binding refuses pools of 2^31 pages or more on this path. kInline 0: the ids are tensors in
// device memory (TransferParams::src_pages, dst_pages).
template <int kInline>
struct InlineIds {
  int32_t src[kInline];
  int32_t dst[kInline];
};

template <>
struct InlineIds<0> {};

}  // namespace jitkv::transfer
