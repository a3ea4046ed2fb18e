// When the MLA writers' CPU kernels (set_mla_kv_buffer_cpu.cpp, rope/rope_cpu.cpp) write kv_buffer rows by
// streaming stores.
#pragma once

#include <cstdint>

#include "jitkv/cpu/row_copy.h"
#include "jitkv/cpu/scatter.h"
#include "mla/parse.h"

namespace jitkv {
namespace mla {

// cpu::want_streaming for payload_bytes written by `threads` threads into a's buffer, whose rows must
// each start on a 64-byte line.
inline bool streamed_rows(const MlaParams& a, int64_t payload_bytes, int threads) {
  return cpu::want_streaming(a.num_slots * cpu::abs64(a.dst_row_stride), payload_bytes, threads) &&
         cpu::aligned64(a.dst) && a.dst_row_stride % 64 == 0;
}

}  // namespace mla
}  // namespace jitkv
