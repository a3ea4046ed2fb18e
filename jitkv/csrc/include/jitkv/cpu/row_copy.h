// Row copies for the CPU scatter kernels. A destination byte outside the segment is never touched, so
// neighbouring data such as an MLA row's tail stays intact.
//
// AVX-512: 64-byte unaligned load/store loop with one masked tail. The non-temporal variant streams
// whole 64-byte lines (destination must be 64-byte aligned) and writes a partial last line with a
// regular masked store; callers issue stream_fence() once per thread after their last streamed row.
// AVX2: 32-byte loop; the tail is one 32-byte move that ends at the segment's end (overlapping bytes
// already written with the same values), or for segments under 32 bytes two overlapping moves of the
// largest power of two that fits. Streaming writes whole lines as two 32-byte halves and the rest with
// regular stores that stay inside the partial line. Scalar builds: memcpy.
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

// dst[0, n) = src[0, n). nt: whole lines streamed (dst must be 64-byte aligned).
inline void copy_seg(char* dst, const char* src, int64_t n, bool nt) {
  int64_t i = 0;
  if (nt) {
    for (; i + 64 <= n; i += 64) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
  } else {
    for (; i + 64 <= n; i += 64) _mm512_storeu_si512(dst + i, _mm512_loadu_si512(src + i));
  }
  if (i < n) copy_tail(dst + i, src + i, n - i);
}

// dst[0, na) = a[0, na); dst[na, na + nb) = b[0, nb). With nt, every whole destination line is built
// in a register (the line that straddles na takes bytes from both sources) and streamed once.
inline void copy_two(char* dst, const char* a, int64_t na, const char* b, int64_t nb, bool nt) {
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
}

#elif defined(JITKV_CPU_AVX2)
inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// One 64-byte line as two 32-byte halves, streamed (nt: dst 64-byte aligned) or stored; the branch is
// loop-invariant (predicted).
inline void store_line(char* dst, __m256i lo, __m256i hi, bool nt) {
  auto* d = reinterpret_cast<__m256i*>(dst);
  if (nt) {
    _mm256_stream_si256(d, lo);
    _mm256_stream_si256(d + 1, hi);
  } else {
    _mm256_storeu_si256(d, lo);
    _mm256_storeu_si256(d + 1, hi);
  }
}

inline void copy_line(char* dst, const char* src, bool nt) { store_line(dst, load32(src), load32(src + 32), nt); }

// dst[0, n) = src[0, n) for B <= n <= 2B: B bytes from the start, B bytes ending at n (memcpy of a
// constant size is one load and one store).
template <int B>
inline void copy_ends(char* dst, const char* src, int64_t n) {
  char head[B], tail[B];
  std::memcpy(head, src, B);
  std::memcpy(tail, src + n - B, B);
  std::memcpy(dst, head, B);
  std::memcpy(dst + n - B, tail, B);
}

// dst[0, n) = src[0, n) for 0 <= n < 64, never writing outside [dst, dst + n).
inline void copy_short(char* dst, const char* src, int64_t n) {
  if (n >= 32) {
    copy_ends<32>(dst, src, n);
  } else if (n >= 16) {
    copy_ends<16>(dst, src, n);
  } else if (n >= 8) {
    copy_ends<8>(dst, src, n);
  } else if (n >= 4) {
    copy_ends<4>(dst, src, n);
  } else if (n >= 2) {
    copy_ends<2>(dst, src, n);
  } else if (n == 1) {
    *dst = *src;
  }
}

// dst[0, n) = src[0, n). nt: whole lines streamed (dst must be 64-byte aligned); a partial last line
// is written with regular stores inside it, never over a streamed line.
inline void copy_seg(char* dst, const char* src, int64_t n, bool nt) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) copy_line(dst + i, src + i, nt);
  if (i == n) return;
  if (i > 0 && !nt) {
    copy_line(dst + n - 64, src + n - 64, false);  // the last 64 bytes, overlapping the last whole line
  } else {
    copy_short(dst + i, src + i, n - i);
  }
}

// dst[0, na) = a[0, na); dst[na, na + nb) = b[0, nb). With nt, whole destination lines are streamed;
// the line that straddles na is staged on the stack from both sources first.
inline void copy_two(char* dst, const char* a, int64_t na, const char* b, int64_t nb, bool nt) {
  if (!nt) {
    copy_seg(dst, a, na, false);
    copy_seg(dst + na, b, nb, false);
    return;
  }
  const int64_t total = na + nb;
  int64_t o = 0;
  for (; o + 64 <= na; o += 64) copy_line(dst + o, a + o, true);
  if (o < na) {  // line straddling the boundary: bytes [o, na) from a, the rest from b
    alignas(32) char line[64];
    const int64_t ra = na - o, rb = total - na < 64 - ra ? total - na : 64 - ra;
    std::memcpy(line, a + o, static_cast<size_t>(ra));
    std::memcpy(line + ra, b, static_cast<size_t>(rb));
    if (ra + rb == 64) {
      copy_line(dst + o, line, true);
    } else {
      copy_short(dst + o, line, ra + rb);
    }
    o += 64;
  }
  for (; o + 64 <= total; o += 64) copy_line(dst + o, b + (o - na), true);
  if (o < total) copy_short(dst + o, b + (o - na), total - o);
}

#else
inline void copy_seg(char* dst, const char* src, int64_t n, bool) { std::memcpy(dst, src, static_cast<size_t>(n)); }

inline void copy_two(char* dst, const char* a, int64_t na, const char* b, int64_t nb, bool) {
  std::memcpy(dst, a, static_cast<size_t>(na));
  std::memcpy(dst + na, b, static_cast<size_t>(nb));
}
#endif

// Orders this thread's streamed stores before anything that follows (end of the op / OpenMP barrier).
inline void stream_fence() {
#if defined(JITKV_CPU_AVX512) || defined(JITKV_CPU_AVX2)
  _mm_sfence();
#endif
}

inline bool nt_available() {
#if defined(JITKV_CPU_AVX512) || defined(JITKV_CPU_AVX2)
  return true;
#else
  return false;
#endif
}

inline bool aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }

}  // namespace cpu
}  // namespace jitkv
