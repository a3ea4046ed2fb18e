// Host-side argument checks shared by every tvm-ffi binding (CPU and CUDA).
// Each failure raises a Python TypeError/ValueError/IndexError whose message starts with
// "<op>: <argument>: " so callers see which tensor was wrong and what was expected.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/optional.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>

namespace jitkv {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

inline int64_t elem_bytes(DLDataType t) { return (int64_t(t.bits) * t.lanes + 7) / 8; }

// TensorView::data_ptr() ignores byte_offset (0 for torch tensors, not in general).
inline char* data_ptr(const TensorView& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); }

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

inline bool same_device(DLDevice a, DLDevice b) { return a.device_type == b.device_type && a.device_id == b.device_id; }

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
inline void check_device(const char* op, const char* name, const TensorView& t, DLDevice dev, const char* dest_name) {
  if (!same_device(t.device(), dev)) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a tensor on " << device_str(dev) << " like "
                              << dest_name << ", got one on " << device_str(t.device());
  }
}

inline void check_same_dtype(const char* op, const char* name, const TensorView& t, DLDataType want,
                             const char* want_from) {
  if (t.dtype() != want) {
    TVM_FFI_THROW(TypeError) << op << ": " << name << ": expected dtype " << want << " (the dtype of " << want_from
                             << "), got " << t.dtype();
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
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a 1-D tensor, got shape " << shape_str(t);
  }
  if (t.size(0) > 1 && t.stride(0) != 1) {
    TVM_FFI_THROW(ValueError) << op << ": " << name << ": expected a contiguous tensor, got stride " << t.stride(0);
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

// A destination whose elements are distinct memory: no stride 0 in a dim of size > 1 (an expand()ed
// cache would make every slot one row). The same message as jitkv/checks.py written().
inline void check_written(const char* op, const char* name, const TensorView& t) {
  for (int d = 0; d < t.ndim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) {
      TVM_FFI_THROW(ValueError) << op << ": " << name << ": dim " << d << " of size " << t.size(d)
                                << " has stride 0: its rows would alias (an expand()ed view?); expected a tensor "
                                << "whose elements are distinct memory";
    }
  }
}

namespace detail {

// The byte range [lo, hi) a tensor's elements span (lo == hi: no element).
inline void byte_extent(const TensorView& t, int64_t& lo, int64_t& hi) {
  const int64_t es = elem_bytes(t.dtype());
  lo = hi = reinterpret_cast<int64_t>(data_ptr(t));
  for (int d = 0; d < t.ndim(); ++d) {
    if (t.size(d) == 0) {
      hi = lo;
      return;
    }
    const int64_t span = (t.size(d) - 1) * t.stride(d) * es;
    (span < 0 ? lo : hi) += span;
  }
  hi += es;
}

// Whether sum(c_d * stride_d) == delta for some |c_d| < size_d, strides sorted ascending in dims[0, n).
inline bool reach(int64_t delta, const int64_t (*dims)[2], int n) {
  if (n == 0) return delta == 0;
  const int64_t stride = dims[n - 1][0], size = dims[n - 1][1];
  int64_t span = 0;
  for (int i = 0; i < n - 1; ++i) span += (dims[i][1] - 1) * dims[i][0];
  const int64_t lo = delta >= 0 ? delta / stride : -((-delta) / stride) - ((-delta) % stride != 0);
  for (int64_t c : {lo, lo + 1}) {
    const int64_t rest = delta - c * stride;
    if ((c < 0 ? -c : c) < size && (rest < 0 ? -rest : rest) <= span && reach(rest, dims, n - 1)) return true;
  }
  return false;
}

// Whether two views of t's shape and strides, `delta` elements apart, share an element. Exact where
// each stride exceeds the span of the smaller ones (every layout jitkv takes); any other layout
// counts as sharing (jitkv/checks.py _offset_reachable).
inline bool offset_reachable(const TensorView& t, int64_t delta) {
  int64_t dims[8][2];
  int n = 0;
  for (int d = 0; d < t.ndim(); ++d) {
    if (t.size(d) <= 1) continue;
    if (n == 8) return true;
    const int64_t st = t.stride(d) < 0 ? -t.stride(d) : t.stride(d);
    int i = n++;
    for (; i > 0 && dims[i - 1][0] > st; --i) {
      dims[i][0] = dims[i - 1][0];
      dims[i][1] = dims[i - 1][1];
    }
    dims[i][0] = st;
    dims[i][1] = t.size(d);
  }
  int64_t span = 0;
  for (int i = 0; i < n; ++i) {
    if (dims[i][0] <= span) return true;
    span += (dims[i][1] - 1) * dims[i][0];
  }
  return reach(delta, dims, n);
}

}  // namespace detail

// Two destinations that share no byte (k_cache and v_cache one tensor would write V over K); the K and
// V halves of one [num_blocks, 2, ...] allocation are separate. The same rule and message as
// jitkv/checks.py disjoint().
inline void check_disjoint(const char* op, const char* name, const TensorView& t, const char* other_name,
                           const TensorView& other) {
  int64_t a_lo, a_hi, b_lo, b_hi;
  detail::byte_extent(t, a_lo, a_hi);
  detail::byte_extent(other, b_lo, b_hi);
  if (!(a_lo < b_hi && b_lo < a_hi)) return;
  bool same_layout = t.dtype() == other.dtype() && t.ndim() == other.ndim();
  for (int d = 0; same_layout && d < t.ndim(); ++d) {
    same_layout = t.size(d) == other.size(d) && t.stride(d) == other.stride(d);
  }
  if (same_layout) {
    const int64_t es = elem_bytes(t.dtype());
    const int64_t bytes = reinterpret_cast<int64_t>(data_ptr(other)) - reinterpret_cast<int64_t>(data_ptr(t));
    if (bytes % es != 0 || !detail::offset_reachable(t, bytes / es)) return;
  }
  TVM_FFI_THROW(ValueError) << op << ": " << name << ": shares memory with " << other_name
                            << "; expected two separate caches";
}

// An fp8 scale the kernels divide by: finite and > 0 as float32 (NaN fails both).
inline bool scale_ok(float v) { return std::isfinite(v) && v > 0.0f; }

// A float32 scale tensor's values, where they lie on the host: each finite and > 0 (what the kernel
// divides by). The wrappers leave a host tensor's values to the bindings, where reading them costs a few
// ns (in Python, microseconds a tensor: docs/performance.md "Host scale tensors"); a device tensor's are
// the kernel's to read (JITKV_DEBUG=1 checks them on the host first). s: 1 element, or 1-D (per-head).
inline void check_host_scale(const char* op, const char* name, const TensorView& s) {
  if (s.device().device_type != kDLCPU) return;
  const float* p = reinterpret_cast<const float*>(data_ptr(s));
  const int64_t n = s.numel(), stride = n > 1 ? s.stride(0) : 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = p[i * stride];
    if (!scale_ok(v)) {
      const std::string at = n > 1 ? std::string(name) + "[" + std::to_string(i) + "]" : std::string(name);
      TVM_FFI_THROW(ValueError) << op << ": " << at << ": must be finite and > 0, got " << v;
    }
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A base address and the byte strides stepping from it, all multiples of unit (a vector access's bytes).
inline bool aligned(const void* ptr, int64_t unit, std::initializer_list<int64_t> strides = {}) {
  if (reinterpret_cast<uintptr_t>(ptr) % unit) return false;
  for (int64_t s : strides) {
    if (s % unit) return false;
  }
  return true;
}

// Dtypes a plain (bitwise) row copy accepts: bf16, fp16, fp32, uint8, float8_e4m3fn, float8_e5m2.
inline bool is_copy_dtype(DLDataType d) {
  if (d.lanes != 1) return false;
  switch (d.code) {
    case kDLFloat:
      return d.bits == 16 || d.bits == 32;
    case kDLBfloat:
      return d.bits == 16;
    case kDLUInt:
      return d.bits == 8;
    case kDLFloat8_e4m3fn:
    case kDLFloat8_e5m2:
      return d.bits == 8;
    default:
      return false;
  }
}

inline bool is_float8(DLDataType d) { return d.code == kDLFloat8_e4m3fn || d.code == kDLFloat8_e5m2; }

}  // namespace jitkv
