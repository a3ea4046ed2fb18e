// tvm-ffi binding of the DeepSeek-V4 FP8 K cache kernels (write.cuh, gather.cuh): checks every argument,
// builds the kernel's parameter block (params.h) and launches on the caller's current stream of the
// cache's device (jitkv/cuda/launch.cuh: PDL from sm_90, device guard). Empty work returns without a
// launch. The record is codes::Dsv4; the module has no template arguments.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <cstdint>

#include "dsv4/gather.cuh"
#include "dsv4/params.h"
#include "dsv4/write.cuh"
#include "jitkv/check.h"
#include "jitkv/cuda/launch.cuh"

namespace {

using jitkv::aligned16;
using jitkv::data_ptr;
using jitkv::shape_str;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;
namespace layout = jitkv::dsv4;
using namespace jitkv::dsv4;

constexpr DLDataType kBf16{kDLBfloat, 16, 1};
constexpr DLDataType kUint8{kDLUInt, 8, 1};
constexpr DLDataType kInt32{kDLInt, 32, 1};

void check_dtype(const char* op, const char* name, const TensorView& t, DLDataType want, const char* want_name) {
  if (t.dtype() != want) {
    TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected dtype " << want_name << ", got " << t.dtype();
  }
}

void check_block_size(const char* op, int64_t block_size) {
  if (block_size <= 0 || block_size > INT32_MAX) {
    TVM_FFI_THROW(ValueError) << op << ": block_size: expected 1 <= block_size < 2^31, got " << block_size;
  }
}

struct CacheView {
  void* ptr;
  int64_t block_stride;  // bytes
  int64_t num_blocks;
};

// uint8 [num_blocks, >= block_size*584], or [num_blocks, block_size, 584] with tokens 584 bytes apart;
// kernels use stride(0) and touch the first block_size*584 bytes of each block. These guards keep the
// kernels inside the tensor with aligned 16-byte accesses; the layout's semantics (the block size a
// cache holds, a block stride >= block_size*584) are checked once, in Python (DSV4_K_CACHE.validate).
CacheView check_cache(const char* op, const TensorView& c, int64_t block_size) {
  if (c.device().device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << op << ": k_cache: expected a CUDA tensor, got device_type " << c.device().device_type;
  }
  check_dtype(op, "k_cache", c, kUint8, "uint8");
  if (c.ndim() == 2) {
    if (c.size(1) < block_size * layout::kTokenBytes) {
      TVM_FFI_THROW(ValueError) << op << ": k_cache: expected [num_blocks, >= " << block_size
                                << " * 584] bytes per block for block_size " << block_size << ", got shape "
                                << shape_str(c);
    }
  } else if (c.ndim() == 3) {
    if (c.size(1) != block_size || c.size(2) != layout::kTokenBytes ||
        (block_size > 1 && c.stride(1) != layout::kTokenBytes)) {
      TVM_FFI_THROW(ValueError) << op << ": k_cache: expected shape [num_blocks, " << block_size
                                << ", 584] with stride(1) 584, got " << shape_str(c);
    }
  } else {
    TVM_FFI_THROW(ValueError) << op << ": k_cache: expected a 2-D [num_blocks, block_stride] or 3-D "
                              << "[num_blocks, block_size, 584] uint8 tensor, got shape " << shape_str(c);
  }
  jitkv::check_last_dim_contiguous(op, "k_cache", c);
  const int64_t stride = c.size(0) > 1 ? c.stride(0) : 0;  // one block: never multiplied
  if (stride % 16 != 0 || !aligned16(data_ptr(c))) {
    TVM_FFI_THROW(ValueError) << op << ": k_cache: expected a 16-byte aligned data pointer and stride(0) "
                              << "(the block stride in bytes) a multiple of 16, got stride " << c.stride(0);
  }
  return {data_ptr(c), stride, c.size(0)};
}

// 1-D dense int32 of length num_reqs on the cache's device.
void check_req_index(const char* op, const char* name, const TensorView& t, int64_t num_reqs, DLDevice dev) {
  jitkv::check_index(op, name, t);
  check_dtype(op, name, t, kInt32, "int32");
  if (t.size(0) != num_reqs) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected " << num_reqs << " entries (out.shape[0]), got "
                              << t.size(0);
  }
  jitkv::check_device(op, name, t, dev, "k_cache");
}

cudaStream_t current_stream(DLDevice dev) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
}

// Writer grid: one warp per token (kWriteTok per warp), warps per CTA spread by n (launch.cuh).
void launch_quantize_insert(const char* op, int device, cudaStream_t stream, const WriteParams& p, bool slots64) {
  const int64_t warps = (p.n + kWriteTok - 1) / kWriteTok;
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(device);
  const int per_cta = jitkv::cuda::spread_warps_per_block(warps, info.sms, kWriteWarps);
  const int64_t grid = (warps + per_cta - 1) / per_cta;
  if (grid > 0x7FFFFFFF) jitkv::cuda::check_launch(op, cudaErrorInvalidConfiguration);
  auto kernel = slots64 ? dsv4_quant_insert_kernel<int64_t> : dsv4_quant_insert_kernel<int32_t>;
  jitkv::cuda::DeviceGuard guard(device);
  jitkv::cuda::check_launch(
      op, jitkv::cuda::launch(kernel, dim3(static_cast<unsigned>(grid)), dim3(per_cta * 32), stream, info.pdl(), p));
}

// Gather grid: one CTA per tile of positions, capped at kGatherWaves waves of resident CTAs (the
// kernel's launch bounds make kGatherMinCtas of them fit per SM).
void launch_dequant_gather(const char* op, int device, cudaStream_t stream, GatherParams& p, int64_t num_reqs) {
  constexpr int64_t kTile = int64_t(kGatherWarps) * kGatherTok;
  p.tiles_per_req = (p.rows + kTile - 1) / kTile;
  p.num_tiles = num_reqs * p.tiles_per_req;
  const jitkv::cuda::DeviceInfo info = jitkv::cuda::device_info(device);
  const int64_t cap = kGatherWaves * kGatherMinCtas * (info.sms > 0 ? info.sms : 1);
  const int64_t grid = p.num_tiles < cap ? p.num_tiles : cap;
  jitkv::cuda::DeviceGuard guard(device);
  jitkv::cuda::check_launch(op, jitkv::cuda::launch(dsv4_gather_kernel, dim3(static_cast<unsigned>(grid)),
                                                    dim3(kGatherWarps * 32), stream, info.pdl(), p));
}

}  // namespace

void quantize_and_insert_k_cache(TensorView k, TensorView k_cache, TensorView slot_mapping, int64_t block_size) {
  constexpr const char* op = "quantize_and_insert_k_cache";
  check_block_size(op, block_size);
  const CacheView cache = check_cache(op, k_cache, block_size);
  const DLDevice dev = k_cache.device();
  const bool slots64 = jitkv::check_index(op, "slot_mapping", slot_mapping);
  jitkv::check_device(op, "slot_mapping", slot_mapping, dev, "k_cache");
  check_dtype(op, "k", k, kBf16, "bfloat16");
  jitkv::check_device(op, "k", k, dev, "k_cache");
  const int64_t n = slot_mapping.size(0);
  if (k.ndim() != 2 || k.size(1) != layout::kHeadDim || k.size(0) < n) {
    TVM_FFI_THROW(ValueError) << op << ": k: expected shape [n', 512] with n' >= " << n
                              << " (slot_mapping.numel()), got " << shape_str(k);
  }
  jitkv::check_last_dim_contiguous(op, "k", k);
  const int64_t k_stride = k.size(0) > 1 ? k.stride(0) : layout::kHeadDim;
  if (!aligned16(data_ptr(k)) || k_stride % 8 != 0) {
    TVM_FFI_THROW(ValueError) << op << ": k: expected a 16-byte aligned data pointer and a row stride "
                              << "that is a multiple of 8 elements, got stride " << k_stride;
  }
  if (n == 0) return;
  const WriteParams p{reinterpret_cast<const uint16_t*>(data_ptr(k)),
                      k_stride,
                      static_cast<uint8_t*>(cache.ptr),
                      cache.block_stride,
                      cache.num_blocks * block_size,
                      data_ptr(slot_mapping),
                      n,
                      block_size};
  launch_quantize_insert(op, dev.device_id, current_stream(dev), p, slots64);
}

void dequantize_and_gather_k_cache(TensorView out, TensorView k_cache, TensorView seq_lens,
                                   Optional<TensorView> gather_lens, TensorView block_table, int64_t block_size,
                                   int64_t offset) {
  constexpr const char* op = "dequantize_and_gather_k_cache";
  check_block_size(op, block_size);
  if (offset < 0) {
    TVM_FFI_THROW(ValueError) << op << ": offset: expected >= 0, got " << offset;
  }
  const CacheView cache = check_cache(op, k_cache, block_size);
  const DLDevice dev = k_cache.device();

  check_dtype(op, "out", out, kBf16, "bfloat16");
  jitkv::check_device(op, "out", out, dev, "k_cache");
  if (out.ndim() != 3 || out.size(2) != layout::kHeadDim) {
    TVM_FFI_THROW(ValueError) << op << ": out: expected shape [num_reqs, max_tokens, 512], got " << shape_str(out);
  }
  jitkv::check_last_dim_contiguous(op, "out", out);
  jitkv::check_written(op, "out", out);
  const int64_t num_reqs = out.size(0), max_tokens = out.size(1);
  const int64_t out_s0 = num_reqs > 1 ? out.stride(0) : 0;
  const int64_t out_s1 = max_tokens > 1 ? out.stride(1) : 0;
  if (!aligned16(data_ptr(out)) || out_s0 % 8 != 0 || out_s1 % 8 != 0) {
    TVM_FFI_THROW(ValueError) << op << ": out: expected a 16-byte aligned data pointer and strides "
                              << "that are multiples of 8 elements, got strides (" << out.stride(0) << ", "
                              << out.stride(1) << ")";
  }

  check_req_index(op, "seq_lens", seq_lens, num_reqs, dev);
  const int32_t* gl_ptr = nullptr;
  if (gather_lens.has_value()) {
    const TensorView gl = gather_lens.value();
    check_req_index(op, "gather_lens", gl, num_reqs, dev);
    gl_ptr = static_cast<const int32_t*>(static_cast<void*>(data_ptr(gl)));
  }
  check_dtype(op, "block_table", block_table, kInt32, "int32");
  jitkv::check_device(op, "block_table", block_table, dev, "k_cache");
  if (block_table.ndim() != 2 || block_table.size(0) != num_reqs) {
    TVM_FFI_THROW(ValueError) << op << ": block_table: expected shape [" << num_reqs << ", max_blocks], got "
                              << shape_str(block_table);
  }
  jitkv::check_last_dim_contiguous(op, "block_table", block_table);

  const int64_t rows = max_tokens - offset;  // rows past out.shape[1] are never written
  if (num_reqs == 0 || rows <= 0) return;
  GatherParams p{reinterpret_cast<uint16_t*>(data_ptr(out)),
                 out_s0,
                 out_s1,
                 rows,
                 offset,
                 static_cast<const uint8_t*>(cache.ptr),
                 cache.block_stride,
                 cache.num_blocks,
                 static_cast<const int32_t*>(static_cast<void*>(data_ptr(seq_lens))),
                 gl_ptr,
                 static_cast<const int32_t*>(static_cast<void*>(data_ptr(block_table))),
                 block_table.stride(0),
                 block_table.size(1),
                 static_cast<int32_t>(block_size),
                 0,
                 0};
  launch_dequant_gather(op, dev.device_id, current_stream(dev), p, num_reqs);
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(quantize_and_insert_k_cache, quantize_and_insert_k_cache);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dequantize_and_gather_k_cache, dequantize_and_gather_k_cache);
