// Row copies for the CPU scatter kernels.
//
// AVX-512: 64-byte unaligned load/store loop with one masked tail (a destination byte outside the
// segment is never touched, so neighbouring data such as an MLA row's tail stays intact). The
// non-temporal variant streams whole 64-byte lines (destination must be 64-byte aligned) and writes
// a partial last line with a regular masked store; callers issue stream_fence() once per thread
// after their last streamed row. Without AVX-512 everything is memcpy.
//
// Sizes are runtime values: compile-time segment sizes (tried: 128..2048 B) gave no measurable gain
// here and cost build time, so one build serves every shape.
#pragma once

#include <cstdint>
#include <cstring>

#include "jitkv/cpu/isa.h"

namespace jitkv {
namespace cpu {

#ifdef JITKV_CPU_AVX512
// Bytes [0, r) of a 64-byte lane set, 0 < r <= 64.
inline __mmask64 head_mask(int64_t r) { return r >= 64 ? ~__mmask64(0) : (__mmask64(1) << r) - 1; }

// Streaming stores need a 64-byte aligned destination; the branch is loop-invariant (predicted).
inline void store_line(char* dst, __m512i v, bool nt) {
  if (nt) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  } else {
    _mm512_storeu_si512(dst, v);
  }
}

inline void copy_tail(char* dst, const char* src, int64_t r) {
  __mmask64 m = head_mask(r);
  _mm512_mask_storeu_epi8(dst, m, _mm512_maskz_loadu_epi8(m, src));
}
#endif

// dst[0, n) = src[0, n). nt: whole lines streamed (dst must be 64-byte aligned).
inline void copy_seg(char* dst, const char* src, int64_t n, bool nt) {
#ifdef JITKV_CPU_AVX512
  int64_t i = 0;
  if (nt) {
    for (; i + 64 <= n; i += 64) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
  } else {
    for (; i + 64 <= n; i += 64) _mm512_storeu_si512(dst + i, _mm512_loadu_si512(src + i));
  }
  if (i < n) copy_tail(dst + i, src + i, n - i);
#else
  (void)nt;
  std::memcpy(dst, src, static_cast<size_t>(n));
#endif
}

// dst[0, na) = a[0, na); dst[na, na + nb) = b[0, nb). With nt, every whole destination line is built
// in a register (the line that straddles na takes bytes from both sources) and streamed once.
inline void copy_two(char* dst, const char* a, int64_t na, const char* b, int64_t nb, bool nt) {
#ifdef JITKV_CPU_AVX512
  if (!nt) {
    copy_seg(dst, a, na, false);
    copy_seg(dst + na, b, nb, false);
    return;
  }
  const int64_t total = na + nb;
  int64_t o = 0;
  for (; o + 64 <= na; o += 64) store_line(dst + o, _mm512_loadu_si512(a + o), true);
  if (o < na) {  // line straddling the boundary: bytes [o, na) from a, the rest from b
    __mmask64 all = head_mask(total - o);
    __mmask64 ma = head_mask(na - o);
    __m512i v = _mm512_or_si512(_mm512_maskz_loadu_epi8(ma, a + o),
                                _mm512_maskz_loadu_epi8(all & ~ma, b - (na - o)));  // masked lanes never load
    if (total - o >= 64) {
      store_line(dst + o, v, true);
    } else {
      _mm512_mask_storeu_epi8(dst + o, all, v);
    }
    o += 64;
  }
  for (; o + 64 <= total; o += 64) store_line(dst + o, _mm512_loadu_si512(b + (o - na)), true);
  if (o < total) copy_tail(dst + o, b + (o - na), total - o);
#else
  (void)nt;
  std::memcpy(dst, a, static_cast<size_t>(na));
  std::memcpy(dst + na, b, static_cast<size_t>(nb));
#endif
}

// Orders this thread's streamed stores before anything that follows (end of the op / OpenMP barrier).
inline void stream_fence() {
#ifdef JITKV_CPU_AVX512
  _mm_sfence();
#endif
}

inline bool nt_available() {
#ifdef JITKV_CPU_AVX512
  return true;
#else
  return false;
#endif
}

inline bool aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }

}  // namespace cpu
}  // namespace jitkv
