// Registers of the CUDA kernels and their global loads and stores.
//  - load: the coherent load of everything read after the PDL wait;
//  - VecOf<V>: the type of one V-byte access (V = 1, 2, 4, 8 or 16);
//  - Pack<N>: N bytes in whole registers (N may span several 16-byte vectors), load_pack / store_pack;
//  - load_no_l1_v2 / _v4, load_or: predicated loads (a false predicate reads nothing and yields zeros
//    or the fallback) for data read once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace jitkv {
namespace cuda {

// Every load of what the previous kernel may write (indices, sources, scales, caches; anything read
// after pdl_wait()) goes through load(): a coherent ld.global, never ld.global.nc / __ldg. A
// non-coherent load promises that the data stays read-only for the whole kernel, which PDL breaks (this
// kernel starts while the previous one still writes), and ptxas acts on that promise: it scheduled the
// DSv4 writer's ld.global.nc loads above griddepcontrol.wait. jitkv/tests/jit/test_build.py checks the
// SASS of every kernel for a global access before the wait.
// The load is an LDG even where the compiler only sees a generic pointer, and volatile, so that the
// compiler keeps it after the wait too. T: 1, 2, 4, 8 or 16 bytes.
template <typename T>
__device__ __forceinline__ T load(const T* p) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16,
                "a load of 1, 2, 4, 8 or 16 bytes");
  T v;
  if constexpr (sizeof(T) == 16) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    memcpy(&v, &r, 16);
  } else if constexpr (sizeof(T) == 8) {
    unsigned long long r;
    asm volatile("ld.global.u64 %0, [%1];" : "=l"(r) : "l"(p));
    memcpy(&v, &r, 8);
  } else if constexpr (sizeof(T) == 4) {
    unsigned r;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(r) : "l"(p));
    memcpy(&v, &r, 4);
  } else if constexpr (sizeof(T) == 2) {
    unsigned short r;
    asm volatile("ld.global.u16 %0, [%1];" : "=h"(r) : "l"(p));
    memcpy(&v, &r, 2);
  } else {
    unsigned short r;
    asm volatile("ld.global.u8 %0, [%1];" : "=h"(r) : "l"(p));
    const unsigned char b = static_cast<unsigned char>(r);
    memcpy(&v, &b, 1);
  }
  return v;
}

// Entry i of an index tensor (slot_mapping, loc_map, a page table) of int64 (i64) or int32, by load().
__device__ __forceinline__ int64_t load_index(const void* p, bool i64, int64_t i) {
  return i64 ? load(static_cast<const long long*>(p) + i) : int64_t(load(static_cast<const int*>(p) + i));
}

// An int32 or int64 index loaded and not yet used: value() (the int32 one widened) comes where the caller
// needs it (after the PDL trigger, or after work that does not need it), so the load is in flight meanwhile.
struct LoadedIndex {
  int64_t wide;
  int32_t narrow;
  bool i64;
  __device__ __forceinline__ int64_t value() const { return i64 ? wide : int64_t{narrow}; }
};

__device__ __forceinline__ LoadedIndex load_index_later(const void* p, bool i64, int64_t i) {
  LoadedIndex r{0, 0, i64};
  if (i64) {
    r.wide = load(static_cast<const long long*>(p) + i);
  } else {
    r.narrow = load(static_cast<const int*>(p) + i);
  }
  return r;
}

template <int V>
struct VecOf;
template <>
struct VecOf<16> {
  using T = uint4;
};
template <>
struct VecOf<8> {
  using T = uint2;
};
template <>
struct VecOf<4> {
  using T = uint32_t;
};
template <>
struct VecOf<2> {
  using T = uint16_t;
};
template <>
struct VecOf<1> {
  using T = uint8_t;
};

// N bytes in words, so that they stay in whole registers; loaded through load() (sources), stored
// plainly (caches).
template <int N>
struct Pack {
  static_assert(N % 4 == 0, "packs are 1, 2 or a multiple of 4 bytes");
  uint32_t w[N / 4];
};
template <>
struct Pack<2> {
  uint16_t h;
};
template <>
struct Pack<1> {
  uint8_t b;
};

template <int N>
__device__ __forceinline__ Pack<N> load_pack(const char* p) {
  Pack<N> r;
  if constexpr (N >= 16) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      const uint4 q = load(reinterpret_cast<const uint4*>(p) + i);
      r.w[4 * i] = q.x, r.w[4 * i + 1] = q.y, r.w[4 * i + 2] = q.z, r.w[4 * i + 3] = q.w;
    }
  } else if constexpr (N == 8) {
    const uint2 q = load(reinterpret_cast<const uint2*>(p));
    r.w[0] = q.x, r.w[1] = q.y;
  } else if constexpr (N == 4) {
    r.w[0] = load(reinterpret_cast<const unsigned int*>(p));
  } else if constexpr (N == 2) {
    r.h = load(reinterpret_cast<const unsigned short*>(p));
  } else {
    r.b = load(reinterpret_cast<const unsigned char*>(p));
  }
  return r;
}

template <int N>
__device__ __forceinline__ void store_pack(char* p, const Pack<N>& v) {
  if constexpr (N >= 16) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i)
      reinterpret_cast<uint4*>(p)[i] = make_uint4(v.w[4 * i], v.w[4 * i + 1], v.w[4 * i + 2], v.w[4 * i + 3]);
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(v.w[0], v.w[1]);
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint32_t*>(p) = v.w[0];
  } else if constexpr (N == 2) {
    *reinterpret_cast<uint16_t*>(p) = v.h;
  } else {
    *reinterpret_cast<uint8_t*>(p) = v.b;
  }
}

// Loads of data read once (a cache row, a source row): L1 is skipped. A false predicate loads no
// memory and yields zeros; the asm is volatile, so the loads stay after the PDL wait (as load()'s).
__device__ __forceinline__ uint2 load_no_l1_v2(const void* p, bool pred) {
  uint2 v;
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %3, 0; mov.b32 %0, 0; mov.b32 %1, 0;\n"
      "@p ld.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];}"
      : "=r"(v.x), "=r"(v.y)
      : "l"(p), "r"(int(pred)));
  return v;
}

__device__ __forceinline__ uint4 load_no_l1_v4(const void* p, bool pred) {
  uint4 v;
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %5, 0; mov.b32 %0, 0; mov.b32 %1, 0; mov.b32 %2, 0; mov.b32 %3, 0;\n"
      "@p ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];}"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"(int(pred)));
  return v;
}

// *p, or `fallback` without a memory access when pred is false.
__device__ __forceinline__ int32_t load_or(const int32_t* p, bool pred, int32_t fallback) {
  int32_t v;
  asm volatile(
      "{.reg .pred p; setp.ne.b32 p, %2, 0; mov.b32 %0, %3;\n"
      "@p ld.global.s32 %0, [%1];}"
      : "=r"(v)
      : "l"(p), "r"(int(pred)), "r"(fallback));
  return v;
}

}  // namespace cuda
}  // namespace jitkv
