// transfer_pages' host-side plan, for the backends that read the page ids on the host (the CPU kernel
// and the CUDA copy-engine path): the pairs to copy, after docs/design.md §3's id rules.
#pragma once

#include <tvm/ffi/error.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "transfer/params.h"

namespace jitkv::transfer {

struct PagePair {
  int64_t src, dst;  // page ids
};

inline int64_t host_id(const void* p, int64_t i, bool i64) {
  return i64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// The pairs to copy, in call order, each destination page once: a negative id in either tensor skips
// the pair, an id past its pool raises IndexError naming the position before anything is copied, and
// of pairs naming one destination page the last wins (two pairs racing on one page in a parallel or
// unordered copy could interleave their bytes).
inline std::vector<PagePair> resolve_pairs(const char* op, const TransferParams& p) {
  std::vector<PagePair> pairs;
  pairs.reserve(static_cast<size_t>(p.n));
  bool sorted = true;
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t s = host_id(p.src_pages, i, p.src_i64), d = host_id(p.dst_pages, i, p.dst_i64);
    if (s < 0 || d < 0) continue;
    if (s >= p.src.num_pages) {
      TVM_FFI_THROW(IndexError) << op << ": src_pages: position " << i << " has page " << s
                                << ", out of range for a pool of " << p.src.num_pages << " pages";
    }
    if (d >= p.dst.num_pages) {
      TVM_FFI_THROW(IndexError) << op << ": dst_pages: position " << i << " has page " << d
                                << ", out of range for a pool of " << p.dst.num_pages << " pages";
    }
    sorted = sorted && (pairs.empty() || pairs.back().dst < d);
    pairs.push_back(PagePair{s, d});
  }
  if (sorted) return pairs;  // strictly increasing destinations: no duplicates (the common case)
  // A stable sort by destination keeps pairs in call order within a page: the last of each run wins.
  std::stable_sort(pairs.begin(), pairs.end(), [](const PagePair& a, const PagePair& b) { return a.dst < b.dst; });
  size_t m = 0;
  for (size_t k = 0; k < pairs.size(); ++k) {
    if (k + 1 < pairs.size() && pairs[k + 1].dst == pairs[k].dst) continue;
    pairs[m++] = pairs[k];
  }
  pairs.resize(m);
  return pairs;
}

}  // namespace jitkv::transfer
