// Host-side argument checks shared by every tvm-ffi binding (CPU and CUDA).
// Each failure raises a Python TypeError/ValueError/IndexError whose message starts with
// "<op>: <argument>: " so callers see which tensor was wrong and what was expected.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/optional.h>

#include <cstdint>
#include <sstream>
#include <string>

namespace jitkv {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

inline int64_t elem_bytes(DLDataType t) { return (int64_t(t.bits) * t.lanes + 7) / 8; }

// TensorView::data_ptr() ignores byte_offset (0 for torch tensors, not in general).
inline char* data_ptr(const TensorView& t) {
  return static_cast<char*>(t.data_ptr()) + t.byte_offset();
}

inline std::string dtype_name(DLDataType t) {
  std::ostringstream os;
  os << t;
  return os.str();
}

inline std::string shape_str(const TensorView& t) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < t.ndim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << "]";
  return os.str();
}

inline bool same_device(DLDevice a, DLDevice b) {
  return a.device_type == b.device_type && a.device_id == b.device_id;
}

inline std::string device_str(DLDevice d) {
  std::ostringstream os;
  if (d.device_type == kDLCPU) {
    os << "cpu";
  } else if (d.device_type == kDLCUDA) {
    os << "cuda:" << d.device_id;
  } else {
    os << "device_type " << d.device_type << ":" << d.device_id;
  }
  return os.str();
}

// t on dev, the device of the destination dest_name (the same message as the Python validators).
inline void check_device(const char* op, const char* name, const TensorView& t, DLDevice dev,
                         const char* dest_name) {
  if (!same_device(t.device(), dev)) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a tensor on " << device_str(dev)
                              << " like " << dest_name << ", got one on " << device_str(t.device());
  }
}

inline void check_same_dtype(const char* op, const char* name, const TensorView& t, DLDataType want,
                             const char* want_from) {
  if (t.dtype() != want) {
    TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected dtype " << want << " (the dtype of "
                             << want_from << "), got " << t.dtype();
  }
}

inline void check_last_dim_contiguous(const char* op, const char* name, const TensorView& t) {
  if (t.ndim() > 0 && t.size(t.ndim() - 1) > 1 && t.stride(t.ndim() - 1) != 1) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": innermost dim must be contiguous (stride 1), "
                              << "got stride " << t.stride(t.ndim() - 1);
  }
}

// Index tensors (slot_mapping, loc, loc_map, seq_lens, ...): 1-D, int32 or int64, dense.
// Returns true for int64, false for int32.
inline bool check_index(const char* op, const char* name, const TensorView& t) {
  DLDataType d = t.dtype();
  if (d.code != kDLInt || (d.bits != 32 && d.bits != 64) || d.lanes != 1) {
    TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected dtype int32 or int64, got " << d;
  }
  if (t.ndim() != 1) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a 1-D tensor, got shape "
                              << shape_str(t);
  }
  if (t.size(0) > 1 && t.stride(0) != 1) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a contiguous tensor, got stride "
                              << t.stride(0);
  }
  return d.bits == 64;
}

// Sources carry at least one row per index entry (extra rows are never read).
inline void check_rows_at_least(const char* op, const char* name, const TensorView& t, int64_t n,
                                const char* index_name) {
  if (t.size(0) < n) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected at least " << n << " rows (" << index_name
                              << ".numel()), got " << t.size(0);
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Dtypes a plain (bitwise) row copy accepts: bf16, fp16, fp32, uint8, float8_e4m3fn, float8_e5m2.
inline bool is_copy_dtype(DLDataType d) {
  if (d.lanes != 1) return false;
  switch (d.code) {
    case kDLFloat: return d.bits == 16 || d.bits == 32;
    case kDLBfloat: return d.bits == 16;
    case kDLUInt: return d.bits == 8;
    case kDLFloat8_e4m3fn:
    case kDLFloat8_e5m2: return d.bits == 8;
    default: return false;
  }
}

inline bool is_float8(DLDataType d) {
  return d.code == kDLFloat8_e4m3fn || d.code == kDLFloat8_e5m2;
}

}  // namespace jitkv
