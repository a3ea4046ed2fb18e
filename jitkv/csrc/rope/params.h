// rope's parameter blocks, shared by host and device (docs/design.md §9): the rows of one rotated tensor,
// the rotation every token shares (positions, the cos/sin table) and what happens to the queries. The
// CPU binding (rope_cpu.cpp) reads them as parse.h fills them; a CUDA kernel's own compact block is built
// from the same fields.
#pragma once

#include <cstdint>

#include "jitkv/codes.h"

namespace jitkv::rope {

using codes::RopeQ;

// Rows of one tensor, [n', H, W] (2-D rows: one head, stride_head 0). Strides in bytes.
struct Rows {
  char* ptr;
  int64_t stride_token, stride_head;
};

// The rotation every token shares: its position's row of the cos/sin table.
struct Rotation {
  const void* positions;
  bool pos_i64;
  int64_t max_pos;
  const char* cos_sin;  // [max_pos, rot]: cos half then sin half
  int64_t cs_stride;    // bytes
  codes::SrcDtype cs_dtype;  // F32 or the sources' dtype
  int64_t rot;          // rotary dim (even)
  bool neox;            // NeoX halves, else GPT-J pairs
};

// The queries: rotated from src into dst (dst == src in place) as mode says.
struct Queries {
  RopeQ mode;
  Rows src, dst;
  int64_t heads;
  const float* scale_ptr;  // fp8 q_out: a 1-element float32 tensor, or nullptr: scale
  float scale;
};

}  // namespace jitkv::rope
