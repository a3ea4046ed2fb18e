// Slot resolution and the threading / streaming policy shared by the CPU scatter kernels.
//
// resolve_slots() runs serially before any write: it applies the KV-write contract (slot < 0 skipped,
// skip_slot skipped, optional loc_map translation with mapped < 0 skipped) and raises IndexError for an
// out-of-range slot, so the (possibly OpenMP) copy pass never throws. It returns the kept (row, slot)
// pairs, so the copy loop has no branches and threads split real work evenly.
// threads_for() gives each thread of an OpenMP team at least kBytesPerThread of payload: one thread
// below twice that (for_rows then uses a plain `if`: `omp parallel if(...)` still enters libgomp),
// and at most omp_get_max_threads() (torch shares libgomp, so torch.set_num_threads applies), so a
// many-core host does not fork and join its whole team for a mid-size call.
// want_streaming() picks non-temporal stores when the written lines are cold (see there).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "jitkv/check.h"
#include "jitkv/cpu/caches.h"
#include "jitkv/cpu/row_copy.h"

namespace jitkv {
namespace cpu {

// Measured crossover of one thread against two (docs/performance.md, kBytesPerThread).
constexpr int64_t kBytesPerThread = int64_t(96) << 10;

struct RowSlot {
  int64_t row, slot;
};

// Storage for n RowSlots: on the stack for small n (the per-call latency case), else on the heap.
class RowSlotBuffer {
 public:
  explicit RowSlotBuffer(int64_t n) {
    if (n > kStack) heap_.reset(new RowSlot[n]);
  }
  RowSlot* data() { return heap_ ? heap_.get() : stack_; }

 private:
  static constexpr int64_t kStack = 128;
  RowSlot stack_[kStack];
  std::unique_ptr<RowSlot[]> heap_;
};

// Fills out[] with the rows to write and their final slots; returns how many. map == nullptr: no
// loc_map; else int64 when map_i64, int32 otherwise.
template <class IdxT>
int64_t resolve_slots(const char* op, const char* idx_name, const IdxT* idx, int64_t n, int64_t skip_slot,
                      const void* map, bool map_i64, int64_t map_size, int64_t num_slots, RowSlot* out) {
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t s = static_cast<int64_t>(idx[i]);
    if (s < 0 || s == skip_slot) continue;
    if (map) {
      if (s >= map_size) {
        TVM_FFI_THROW(IndexError) << op << ": " << idx_name << ": position " << i << " has slot " << s
                                  << ", out of range for loc_map of size " << map_size;
      }
      int64_t t = map_i64 ? static_cast<const int64_t*>(map)[s] : static_cast<const int32_t*>(map)[s];
      if (t < 0) continue;
      if (t >= num_slots) {
        TVM_FFI_THROW(IndexError) << op << ": loc_map: " << idx_name << " position " << i << " (slot " << s
                                  << ") maps to " << t << ", out of range for a cache of " << num_slots << " slots";
      }
      s = t;
    } else if (s >= num_slots) {
      TVM_FFI_THROW(IndexError) << op << ": " << idx_name << ": position " << i << " has slot " << s
                                << ", out of range for a cache of " << num_slots << " slots";
    }
    out[m++] = RowSlot{i, s};
  }
  return m;
}

// Threads for a payload: one per kBytesPerThread, a team only from two of them.
inline int threads_for(int64_t payload_bytes) {
  const int64_t t = payload_bytes / kBytesPerThread;
  return t < 2 ? 1 : static_cast<int>(std::min<int64_t>(t, omp_get_max_threads()));
}

// Streaming stores skip the read-for-ownership of each destination line but push it out of the
// caches. Worth it when the written lines are cold anyway: the destination spans more than twice the
// LLC (new rows of such a cache are cold at least half the time; docs/performance.md "The streaming
// rule's span"), or one thread writes more than its L2 holds (at 2 MB per thread streaming is 1.4x
// faster, at 1 MB 1.3x slower, on rows the last call left in the caches).
inline bool want_streaming(int64_t dst_span_bytes, int64_t payload_bytes, int threads) {
  return nt_available() && (dst_span_bytes > 2 * llc_bytes() || payload_bytes / threads >= l2_bytes());
}

// body(begin, end) over [0, m) kept rows, split statically across `threads` threads.
template <class F>
inline void for_rows(int64_t m, int threads, F&& body) {
  if (threads <= 1 || m < 2) {
    body(int64_t(0), m);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    body(m * t / nt, m * (t + 1) / nt);
  }
}

inline int64_t abs64(int64_t x) { return x < 0 ? -x : x; }

}  // namespace cpu
}  // namespace jitkv
