// tvm-ffi binding of set_mla_kv_buffer on CUDA. Validates the arguments (mla_args.h), checks that this
// module was compiled for their nope/rope byte sizes, and launches the kernel of
// set_mla_kv_buffer_cuda.cu on the current tvm-ffi (torch) stream under a device guard (the launcher's:
// this file needs no CUDA header).
//
// `path`: bits 0-1 pick the kernel: 0 = auto (the launcher's measured choice: vector stores, see
// set_mla_kv_buffer_cuda.cu), 1 = TMA bulk store (ValueError with the reason where not possible:
// below SM90, destination not 16-byte aligned), 2 = vector stores. Bit 2 (value 4) launches without programmatic dependent launch. Bit 3
// (value 8) loads the source rows together with their slots (one memory round trip less at small n;
// padding rows' sources are then read, though never written).
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "jitkv/check.h"
#include "mla/mla_args.h"
#include "mla/set_mla_kv_buffer_launch.h"

#if !defined(JITKV_NOPE_BYTES) || !defined(JITKV_ROPE_BYTES)
#error "set_mla_kv_buffer_cuda.cc needs -DJITKV_NOPE_BYTES=<bytes> -DJITKV_ROPE_BYTES=<bytes>"
#endif

namespace {

using tvm::ffi::TensorView;

constexpr const char* kOp = "set_mla_kv_buffer";
constexpr int64_t kPathMask = 3;
constexpr int64_t kNoPdl = 4;

void check_cuda_device(const char* name, DLDevice dev) {
  if (dev.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << kOp << ": " << name << ": expected a CUDA tensor, got device_type "
                              << dev.device_type;
  }
}

void check_row_bytes(int64_t nope_bytes, int64_t rope_bytes) {
  if (nope_bytes != JITKV_NOPE_BYTES || rope_bytes != JITKV_ROPE_BYTES) {
    TVM_FFI_THROW(ValueError) << kOp << ": k_nope/k_rope: this module was compiled for " << JITKV_NOPE_BYTES
                              << " + " << JITKV_ROPE_BYTES << " bytes per row, got " << nope_bytes << " + "
                              << rope_bytes;
  }
}

int64_t check_path(int64_t path) {
  const int64_t kernel = path & kPathMask;
  if ((path & ~(kPathMask | kNoPdl)) != 0) {
    TVM_FFI_THROW(ValueError) << kOp << ": path: expected 0 (auto), 1 (TMA), 2 (vector) or 3 (latency), "
                              << "optionally + 4 (no PDL), got " << path;
  }
  return kernel;
}

void set_mla_kv_buffer(TensorView kv_buffer, TensorView loc, TensorView k_nope, TensorView k_rope,
                       int64_t skip_slot, int64_t path) {
  const int64_t kernel = check_path(path);
  const jitkv::MlaArgs a = jitkv::parse_mla_args(kOp, kv_buffer, loc, k_nope, k_rope, skip_slot);
  check_cuda_device("kv_buffer", a.device);
  check_row_bytes(a.nope_bytes, a.rope_bytes);
  if (a.n == 0) return;

  JitkvMlaLaunchParams p = {};
  p.dst = a.dst;
  p.nope = a.nope;
  p.rope = a.rope;
  p.loc = a.loc;
  p.n = a.n;
  p.num_slots = a.num_slots;
  p.dst_row_stride = a.dst_row_stride;
  p.nope_row_stride = a.nope_row_stride;
  p.rope_row_stride = a.rope_row_stride;
  p.skip_slot = a.skip_slot;
  p.loc_i64 = a.loc_i64;
  p.device = a.device.device_id;
  p.path = static_cast<int32_t>(kernel);
  p.pdl = (path & kNoPdl) == 0;
  if (kernel == JITKV_MLA_PATH_TMA) {
    if (const char* why = jitkv_set_mla_kv_buffer_tma_blocker(&p)) {
      TVM_FFI_THROW(ValueError) << kOp << ": path=1 (TMA) is not possible: " << why;
    }
  }

  // The launcher sets p.device current around the launch (device guard).
  const int err = jitkv_set_mla_kv_buffer_launch(&p, TVMFFIEnvGetStream(kDLCUDA, p.device));
  if (err != 0) {
    TVM_FFI_THROW(RuntimeError) << kOp << ": kernel launch failed: " << jitkv_set_mla_kv_buffer_error_string(err);
  }
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_mla_kv_buffer, set_mla_kv_buffer);
