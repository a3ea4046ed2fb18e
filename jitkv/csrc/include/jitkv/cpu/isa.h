// The vector path the CPU kernels are compiled for, chosen from the compiler's macros (the build adds
// flags for jitkv.jit.toolchain.cpu_isa() on top of -march=native: -mno-avx512f for avx2, -mno-avx for
// scalar):
//   JITKV_CPU_AVX512  AVX-512 F + BW: 64-byte lines, masked tails.
//   JITKV_CPU_AVX2    AVX2 + F16C + FMA: 32-byte vectors, overlapping or staged tails.
//   neither           portable scalar code (memcpy, the bit formulas of fp8_format.h).
// Each CPU module exports cpu_isa() and cpu_cache_bytes(level) (JITKV_CPU_EXPORT_INFO) so a caller can
// see which path it loaded and the cache sizes its streaming rule uses (caches.h).
#pragma once

#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include "jitkv/cpu/caches.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JITKV_CPU_AVX512 1
#define JITKV_CPU_ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define JITKV_CPU_AVX2 1
#define JITKV_CPU_ISA_NAME "avx2"
#else
#define JITKV_CPU_ISA_NAME "scalar"
#endif

// The per-vector helpers: always inlined, so a large translation unit never calls one per vector
// (through the PLT, as these inline functions have default visibility in the module).
#define JITKV_CPU_VEC inline __attribute__((always_inline))

namespace jitkv {
namespace cpu {

inline tvm::ffi::String isa_name() { return JITKV_CPU_ISA_NAME; }

}  // namespace cpu
}  // namespace jitkv

// Exports cpu_isa() -> "avx512" / "avx2" / "scalar" and cpu_cache_bytes(level) -> bytes (2: L2, 3: the
// LLC); once per module, at global scope.
#define JITKV_CPU_EXPORT_INFO()                                 \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(cpu_isa, jitkv::cpu::isa_name); \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(cpu_cache_bytes, jitkv::cpu::cache_bytes_of)
