// The rope CPU kernel's float32 arithmetic (rope_cpu.cpp): the QK-norm's sum of squares in the fixed
// order of docs/design.md §9 (each group of 8 values folded by halves, then the group sums by halves) and
// the rotation, every product rounded before its sum (the module is built with -ffp-contract=off).
// AVX-512 or AVX2 where built (jitkv/cpu/isa.h), scalar otherwise.
#pragma once

#include <cstdint>

#include "jitkv/cpu/isa.h"
#include "rope/params.h"

namespace jitkv {
namespace rope {

// Sum of s[0, 8): ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)).
inline float fold8(const float* s) {
  const float a0 = s[0] + s[4], a1 = s[1] + s[5], a2 = s[2] + s[6], a3 = s[3] + s[7];
  return (a0 + a2) + (a1 + a3);
}

// g[0, count) summed by halves, padded with zeros to a power of two (adding +0 is exact); g is scratch of
// pow2_at_least(count) values.
inline float fold_by_halves(float* g, int64_t count) {
  int64_t width = pow2_at_least(count);
  for (int64_t i = count; i < width; ++i) g[i] = 0.0f;
  for (; width > 1; width /= 2) {
    for (int64_t j = 0; j < width / 2; ++j) g[j] = g[j] + g[j + width / 2];
  }
  return g[0];
}

// The fixed-order sum of x[0, d) squared (docs/design.md §9): each group of 8 by fold8, the group sums by
// halves. g: scratch of pow2_at_least(d / 8) values.
inline float sum_squares_scalar(const float* x, int64_t d, float* g) {
  for (int64_t i = 0; i < d; i += 8) {
    float s[8];
    for (int j = 0; j < 8; ++j) s[j] = x[i + j] * x[i + j];
    g[i / 8] = fold8(s);
  }
  return fold_by_halves(g, d / 8);
}

#if defined(JITKV_CPU_AVX512) || defined(JITKV_CPU_AVX2)
// The vector builds keep the group sums in registers: vectors of group sums (AVX-512: groups 2k and
// 2k + 1 in a vector's halves, AVX2: group k, each lane of a group holding its sum), zero vectors past
// the last group up to a power of two, folded by halves a vector at a time (group j's fold with group j +
// half is its vector's with the vector half / groups-per-vector further), so no sum goes through memory.

#if defined(JITKV_CPU_AVX512)
using NormVec = __m512;
constexpr int64_t kGroupsPerVec = 2;

// Groups i / 8 and i / 8 + 1 of x (d a multiple of 8: the second is zeros past d).
JITKV_CPU_VEC NormVec group_sums(const float* x, int64_t i, int64_t d) {
  const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>(d - i >= 16 ? 0xffff : 0xff), x + i);
  __m512 s = _mm512_mul_ps(v, v);  // then lanes j ^ 4, j ^ 2, j ^ 1 of each group: fold8's order
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));
}
JITKV_CPU_VEC NormVec zero_vec() { return _mm512_setzero_ps(); }
JITKV_CPU_VEC NormVec add_vec(NormVec a, NormVec b) { return _mm512_add_ps(a, b); }
// The last fold: the vector's two groups.
JITKV_CPU_VEC float last_fold(NormVec v) {
  return _mm512_cvtss_f32(_mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2))));
}
#else
using NormVec = __m256;
constexpr int64_t kGroupsPerVec = 1;

// Group i / 8 of x.
JITKV_CPU_VEC NormVec group_sums(const float* x, int64_t i, int64_t) {
  const __m256 v = _mm256_loadu_ps(x + i);
  __m256 s = _mm256_mul_ps(v, v);  // then lanes j ^ 4, j ^ 2, j ^ 1: fold8's order
  s = _mm256_add_ps(s, _mm256_permute2f128_ps(s, s, 1));
  s = _mm256_add_ps(s, _mm256_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm256_add_ps(s, _mm256_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));
}
JITKV_CPU_VEC NormVec zero_vec() { return _mm256_setzero_ps(); }
JITKV_CPU_VEC NormVec add_vec(NormVec a, NormVec b) { return _mm256_add_ps(a, b); }
JITKV_CPU_VEC float last_fold(NormVec v) { return _mm256_cvtss_f32(v); }
#endif

// Vectors v[0, W) folded by halves into v[0].
template <int W>
JITKV_CPU_VEC void fold_vecs(NormVec* v) {
  if constexpr (W > 1) {
    for (int k = 0; k < W / 2; ++k) v[k] = add_vec(v[k], v[k + W / 2]);
    fold_vecs<W / 2>(v);
  }
}

// The sum over kVecs group-sum vectors: their count a compile-time constant, so that all of them stay in
// registers (a runtime-sized array of vectors lives on the stack, every fold then waiting on a store and
// its reload: docs/performance.md "The norm's sum in registers").
template <int kVecs>
float sum_squares_vecs(const float* x, int64_t d) {
  constexpr int64_t kStep = 8 * kGroupsPerVec;
  NormVec v[kVecs];
  for (int k = 0; k < kVecs; ++k) v[k] = k * kStep < d ? group_sums(x, k * kStep, d) : zero_vec();
  fold_vecs<kVecs>(v);
  return last_fold(v[0]);
}

inline float sum_squares(const float* x, int64_t d, float* g) {
  switch (pow2_at_least(d / 8) / kGroupsPerVec) {
    case 1:
      return sum_squares_vecs<1>(x, d);
    case 2:
      return sum_squares_vecs<2>(x, d);
    case 4:
      return sum_squares_vecs<4>(x, d);
    case 8:
      return sum_squares_vecs<8>(x, d);
    case 16:
      return sum_squares_vecs<16>(x, d);
    case 32:
      return sum_squares_vecs<32>(x, d);
    default:
      return sum_squares_scalar(x, d, g);
  }
}
#else
inline float sum_squares(const float* x, int64_t d, float* g) { return sum_squares_scalar(x, d, g); }
#endif

// x[0, rot) rotated in place: out = x * C + partner(x) * S, each product rounded before the sum; the
// partner of i is i +- h (NeoX) or i ^ 1 (GPT-J). Both halves of a NeoX pair are loaded before either is
// stored, so no copy of x is needed.
inline void rotate(float* x, const float* C, const float* S, int64_t rot, bool neox) {
  const int64_t h = rot / 2;
  int64_t i = 0;
  if (neox) {
#if defined(JITKV_CPU_AVX512)
    for (; i + 16 <= h; i += 16) {
      const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + h + i);
      const __m512 c = _mm512_loadu_ps(C + i), s = _mm512_loadu_ps(S + h + i);  // S: [-s | s]
      _mm512_storeu_ps(x + i, _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s)));
      _mm512_storeu_ps(x + h + i, _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s)));
    }
#elif defined(JITKV_CPU_AVX2)
    for (; i + 8 <= h; i += 8) {
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + h + i);
      const __m256 c = _mm256_loadu_ps(C + i), s = _mm256_loadu_ps(S + h + i);
      _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
      _mm256_storeu_ps(x + h + i, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
    }
#endif
    for (; i < h; ++i) {
      const float a = x[i], b = x[h + i];
      x[i] = a * C[i] - b * S[h + i];
      x[h + i] = b * C[i] + a * S[h + i];
    }
    return;
  }
#if defined(JITKV_CPU_AVX512)
  for (; i + 16 <= rot; i += 16) {  // 8 pairs: the partner vector swaps adjacent lanes
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 a = _mm512_mul_ps(v, _mm512_loadu_ps(C + i));
    const __m512 b = _mm512_mul_ps(_mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)), _mm512_loadu_ps(S + i));
    _mm512_storeu_ps(x + i, _mm512_add_ps(a, b));
  }
#elif defined(JITKV_CPU_AVX2)
  for (; i + 8 <= rot; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 a = _mm256_mul_ps(v, _mm256_loadu_ps(C + i));
    const __m256 b = _mm256_mul_ps(_mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)), _mm256_loadu_ps(S + i));
    _mm256_storeu_ps(x + i, _mm256_add_ps(a, b));
  }
#endif
  for (; i < rot; i += 2) {
    const float a = x[i], b = x[i + 1];
    x[i] = a * C[i] + b * S[i];
    x[i + 1] = b * C[i + 1] + a * S[i + 1];
  }
}

}  // namespace rope
}  // namespace jitkv
