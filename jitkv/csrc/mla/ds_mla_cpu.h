// The fp8_ds_mla record on CPU (docs/design.md §4), shared by the MLA writers' CPU kernels
// (set_mla_kv_buffer_cpu.cpp, rope/rope_cpu.cpp): per tile abs_max, scale = max(amax / 448, FLT_MIN)
// (a true division), the tile's e4m3 values by that scale, then the scales, then the rope bytes.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstring>

#include "jitkv/cpu/fp8.h"
#include "jitkv/cpu/row_copy.h"
#include "mla/parse.h"

namespace jitkv {
namespace mla {

// One record at dst from DsMla::kNope nope values of `kind` and DsMla::kRope 16-bit rope values. nt:
// stream the tiles (dst 64-byte aligned).
inline void write_ds_mla(char* dst, cpu::SrcKind kind, const char* nope, const char* rope, bool nt) {
  float scales[DsMla::kTiles];
  for (int t = 0; t < DsMla::kTiles; ++t) {
    const char* x = nope + 2 * t * DsMla::kTile;
    scales[t] = std::max(cpu::abs_max(kind, x, DsMla::kTile) / DsMla::kFP8Max, FLT_MIN);
    // A tile is whole lines: segments takes the inlined line loop (no call, no tail; a call of the
    // quantizer kept its constants on the stack).
    const cpu::Fp8Quantizer q(cpu::kFp8E4M3, scales[t]);
    cpu::Fp8Quantizer::segments(&q, 0, reinterpret_cast<uint8_t*>(dst) + t * DsMla::kTile, 0, kind, x, 0, 1,
                                DsMla::kTile, nt && DsMla::kTile % 64 == 0);
  }
  std::memcpy(dst + DsMla::kScaleOffset, scales, sizeof(scales));
  cpu::copy_seg(dst + DsMla::kRopeOffset, rope, 2 * DsMla::kRope, false);
}

}  // namespace mla
}  // namespace jitkv
