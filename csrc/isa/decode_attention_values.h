// The third pass of the decode-attention task kernels from the avx512 level up (csrc/isa/
// decode_attention_avx512.cpp and decode_attention_amx.cpp, each compiled with its own level's
// flags; in an anonymous namespace, see csrc/isa/avx512_vec.h): the values weighted by the
// softmax's exponentials, then divided by their sums. The levels keep the exponentials in
// different layouts, so they are read at e[h * eh + t * et].
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "../decode_attention_common.h"
#include "avx512_vec.h"

namespace ragfast {
namespace decode_attention_common {
namespace {

using namespace ragfast::avx512_vec;  // lanes, load16, store16

// Keys ahead whose value rows are prefetched while weighing.
constexpr int64_t kAhead = 16;

// Writes head h's output row: the weighted sums times 1 / the exponentials' sum (0 with no visible key).
inline void write_row(const Task& a, int64_t h, const __m512* sums, int64_t nd, float total) {
  const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.f / total : 0.f);
  void* oh = static_cast<char*>(a.out) + size_t(h * a.o_sh) * (a.bf16 ? 2 : 4);
  for (int64_t c = 0; c < nd; ++c) store16(oh, 16 * c, _mm512_mul_ps(sums[c], inv), lanes(a.D - 16 * c), a.bf16);
}

// Pass 3 for D <= 16 * ND: the heads in groups whose sums stay in registers (at most 24
// vectors), each visible value row widened once per group.
template <int ND>
void weigh_values(const Task& a, const float* e, int64_t eh, int64_t et, const float* total) {
  constexpr int HB = 24 / ND;
  const int64_t G = a.G, groups = (G + HB - 1) / HB, per = (G + groups - 1) / groups;
  const size_t w = a.bf16 ? 2 : 4;
  for (int64_t h0 = 0; h0 < G; h0 += per) {
    const int64_t hb = G - h0 < per ? G - h0 : per;
    __m512 sums[HB][ND];
    for (int i = 0; i < HB; ++i)
      for (int c = 0; c < ND; ++c) sums[i][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < a.T; ++t) {
      if (a.mask && !a.mask[t]) continue;
      const void* vt = static_cast<const char*>(a.v) + size_t(t * a.v_st) * w;
      if (t + kAhead < a.T)  // the value row kAhead keys on (the rows stream from memory once)
        for (int64_t c = 0; c < a.D * int64_t(w); c += 64)
          _mm_prefetch(static_cast<const char*>(vt) + kAhead * a.v_st * int64_t(w) + c, _MM_HINT_T0);
      __m512 vr[ND];
      for (int c = 0; c < ND; ++c) vr[c] = load16(vt, 16 * c, lanes(a.D - 16 * c), a.bf16);
      for (int i = 0; i < HB; ++i) {
        if (i >= hb) break;
        const __m512 p = _mm512_set1_ps(e[(h0 + i) * eh + t * et]);
        for (int c = 0; c < ND; ++c) sums[i][c] = _mm512_fmadd_ps(p, vr[c], sums[i][c]);
      }
    }
    for (int64_t i = 0; i < hb; ++i) write_row(a, h0 + i, sums[i], ND, total[h0 + i]);
  }
}

// Pass 3 for any D <= 256: each value row widened once and added into the G sums kept in scratch.
void weigh_values_any(const Task& a, const float* e, int64_t eh, int64_t et, const float* total, float* acc,
                      int64_t nd, int64_t Dp) {
  const size_t w = a.bf16 ? 2 : 4;
  for (int64_t i = 0; i < a.G * Dp; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
  __m512 vr[16];
  for (int64_t t = 0; t < a.T; ++t) {
    if (a.mask && !a.mask[t]) continue;
    const void* vt = static_cast<const char*>(a.v) + size_t(t * a.v_st) * w;
    for (int64_t c = 0; c < nd; ++c) vr[c] = load16(vt, 16 * c, lanes(a.D - 16 * c), a.bf16);
    for (int64_t h = 0; h < a.G; ++h) {
      const __m512 p = _mm512_set1_ps(e[h * eh + t * et]);
      float* ah = acc + h * Dp;
      for (int64_t c = 0; c < nd; ++c)
        _mm512_storeu_ps(ah + 16 * c, _mm512_fmadd_ps(p, vr[c], _mm512_loadu_ps(ah + 16 * c)));
    }
  }
  __m512 sums[16];
  for (int64_t h = 0; h < a.G; ++h) {
    for (int64_t c = 0; c < nd; ++c) sums[c] = _mm512_loadu_ps(acc + h * Dp + 16 * c);
    write_row(a, h, sums, nd, total[h]);
  }
}

}  // namespace
}  // namespace decode_attention_common
}  // namespace ragfast
