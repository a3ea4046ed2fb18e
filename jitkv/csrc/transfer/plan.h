// transfer_pages' host-side plan, for the backends that read the page ids on the host (the CPU kernel
// and the CUDA copy-engine path): the pairs to copy, after docs/design.md §3's id rules.
#pragma once

#include <tvm/ffi/error.h>

#include <cstddef>
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
  // Sized once and written field by field: push_back of a {s, d} temporary compiles to two 8-byte
  // stores and a 16-byte reload of them, which store forwarding cannot serve (docs/performance.md
  // "Host ids in the parameter block"; re-measure with perf annotate on a call of many host ids).
  std::vector<PagePair> pairs(static_cast<size_t>(p.n));
  PagePair* out = pairs.data();
  size_t kept = 0;
  bool sorted = true;
  int64_t last = -1;
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
    sorted = sorted && last < d;
    last = d;
    out[kept].src = s;
    out[kept].dst = d;
    ++kept;
  }
  pairs.resize(kept);
  if (sorted) return pairs;  // strictly increasing destinations: no duplicates (the common case)
  // Walked from the last pair back with a bitset of destination pages, each page keeps the last pair
  // naming it; the kept pairs stay in call order. O(n), plus pool pages / 8 bytes zeroed (a sort by
  // destination is O(n log n): several times the copy of 64k one-token pages on the host).
  std::vector<uint64_t> seen(static_cast<size_t>((p.dst.num_pages + 63) / 64), 0);
  size_t m = pairs.size();
  for (size_t k = pairs.size(); k-- > 0;) {
    const uint64_t d = static_cast<uint64_t>(pairs[k].dst), bit = uint64_t{1} << (d & 63);
    uint64_t& word = seen[d >> 6];
    if (word & bit) continue;
    word |= bit;
    pairs[--m] = pairs[k];  // m > k before the decrement: only pairs already walked are overwritten
  }
  pairs.erase(pairs.begin(), pairs.begin() + static_cast<std::ptrdiff_t>(m));
  return pairs;
}

}  // namespace jitkv::transfer
