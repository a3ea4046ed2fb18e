// gather_mla_cache's parameter block, shared by host and device: the tokens of each request, from a
// paged MLA cache [num_blocks, block_size, W] through its block table, into contiguous rows of out
// [total_tokens, D], copied or dequantized.
//
// Formats (kv_cache_dtype, a codes::KvFormat): copy ("auto") copies the entry's bytes (out has the
// cache's dtype, D = W); e4m3 / e5m2: out = bf16(float(x) * scale), a per-tensor scale (D = W);
// fp8_ds_mla: the codes::DsMla record [512 e4m3 in tiles of 128 | 4 fp32 tile scales | 64 bf16 rope],
// out = bf16(float(e4m3) * its tile's scale) for the nope dims and the rope dims copied (D = 576). bf16
// rounds to nearest even; a NaN is written as 0x7FFF.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>

#include "jitkv/codes.h"

namespace jitkv::mla_gather {

using codes::DsMla;
using codes::KvFormat;

constexpr int kDsMlaOutDims = DsMla::kNope + DsMla::kRope;  // output values of an fp8_ds_mla record

// Shapes: out [T, D]; kv_cache [num_blocks, block_size, W]; block_table [>= num_reqs, max_blocks];
// cu_seq_lens [num_reqs + 1]; seq_starts [>= num_reqs] or absent. Index tensors int32 or int64. Only
// the innermost dims must be contiguous: the other strides are kept (bytes, block_table: elements).
struct GatherParams {
  char* out;
  const char* cache;
  const void* block_table;
  const void* cu_seq_lens;
  const void* seq_starts;  // nullptr: positions start at 0
  const float* scale_ptr;  // fp8_e4m3/e5m2: a 1-element float32 tensor read on the device, else nullptr
  int64_t rows;            // out.shape[0]
  int64_t num_reqs;
  int64_t out_row_stride;                                      // bytes
  int64_t num_blocks, block_size, block_stride, token_stride;  // strides in bytes
  int64_t bt_row_stride, max_blocks;                           // block_table, in elements
  int64_t entry_bytes, out_row_bytes;  // a cache entry as stored (W elements), an output row (D elements)
  float scale_value;                   // the scale when scale_ptr is nullptr
  KvFormat format;
  bool bt_i64, cu_i64, starts_i64;
  DLDevice device;
};

}  // namespace jitkv::mla_gather
