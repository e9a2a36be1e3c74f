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

// Asks row t of the next task's keys or values (`next`, rows `stride` bytes apart, `bytes` long)
// into L2: one row per key of this task's own loop spreads the next task's reads over this one.
inline void prefetch_next(const void* next, int64_t t, int64_t stride, int64_t bytes) {
  if (!next) return;
  const char* row = static_cast<const char*>(next) + t * stride;
  for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(row + c, _MM_HINT_T1);
}

// Writes head h's output row: the weighted sums times 1 / the exponentials' sum (0 with no visible key).
inline void write_row(const Task& a, int64_t h, const __m512* sums, int64_t nd, float total) {
  const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.f / total : 0.f);
  void* oh = static_cast<char*>(a.out) + size_t(h * a.o_sh) * (a.bf16 ? 2 : 4);
  for (int64_t c = 0; c < nd; ++c) store16(oh, 16 * c, _mm512_mul_ps(sums[c], inv), lanes(a.D - 16 * c), a.bf16);
}

// Pass 3 for heads h0 .. h0 + HB - 1 and D <= 16 * ND: their HB x ND sums, HB exponentials and
// one value vector in registers (HB * (ND + 1) + 2 <= 32). HB and ND are compile-time so that the
// sums stay in registers: with a run-time head count they went to the stack, and the loads and
// stores around each multiply-add made this pass 60% of the task.
template <int ND, int HB, bool BF16>
void weigh_heads(const Task& a, const float* e, int64_t eh, int64_t et, const float* total, int64_t h0) {
  constexpr size_t w = BF16 ? 2 : 4;
  const __mmask16 last = lanes(a.D - 16 * (ND - 1));
  __m512 sums[HB * ND];
#pragma GCC unroll 32
  for (int i = 0; i < HB * ND; ++i) sums[i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < a.T; ++t) {
    if (a.mask && !a.mask[t]) continue;
    const void* vt = static_cast<const char*>(a.v) + size_t(t * a.v_st) * w;
    if (t + kAhead < a.T)  // the value row kAhead keys on (the rows stream from memory once)
      for (int64_t c = 0; c < a.D * int64_t(w); c += 64)
        _mm_prefetch(static_cast<const char*>(vt) + kAhead * a.v_st * int64_t(w) + c, _MM_HINT_T0);
    if (h0 == 0) prefetch_next(a.next_k, t, a.k_st * int64_t(w), a.D * int64_t(w));
    __m512 p[HB];
#pragma GCC unroll 8
    for (int i = 0; i < HB; ++i) p[i] = _mm512_set1_ps(e[(h0 + i) * eh + t * et]);
#pragma GCC unroll 8
    for (int c = 0; c < ND; ++c) {
      const __m512 vr = load16(vt, 16 * c, c == ND - 1 ? last : __mmask16(0xffff), BF16);
#pragma GCC unroll 8
      for (int i = 0; i < HB; ++i) sums[i * ND + c] = _mm512_fmadd_ps(p[i], vr, sums[i * ND + c]);
    }
  }
  // written here, not by write_row: passing sums[i]'s address would keep every sum in memory
#pragma GCC unroll 8
  for (int i = 0; i < HB; ++i) {
    const float tot = total[h0 + i];
    const __m512 inv = _mm512_set1_ps(tot > 0.f ? 1.f / tot : 0.f);
    void* oh = static_cast<char*>(a.out) + size_t((h0 + i) * a.o_sh) * w;
#pragma GCC unroll 8
    for (int c = 0; c < ND; ++c)
      store16(oh, 16 * c, _mm512_mul_ps(sums[i * ND + c], inv), c == ND - 1 ? last : __mmask16(0xffff), BF16);
  }
}

template <int ND, int HB, bool BF16>
void weigh_group(const Task& a, const float* e, int64_t eh, int64_t et, const float* total, int64_t h0, int64_t hb) {
  switch (hb) {
    case 1: return weigh_heads<ND, 1, BF16>(a, e, eh, et, total, h0);
    case 2: return weigh_heads<ND, (HB < 2 ? HB : 2), BF16>(a, e, eh, et, total, h0);
    case 3: return weigh_heads<ND, (HB < 3 ? HB : 3), BF16>(a, e, eh, et, total, h0);
    case 4: return weigh_heads<ND, (HB < 4 ? HB : 4), BF16>(a, e, eh, et, total, h0);
    case 5: return weigh_heads<ND, (HB < 5 ? HB : 5), BF16>(a, e, eh, et, total, h0);
    default: return weigh_heads<ND, HB, BF16>(a, e, eh, et, total, h0);
  }
}

// Pass 3 for D <= 16 * ND: the heads in near-equal groups of at most (30 / (ND + 1)) (5 for
// D = 64, 3 for D = 128), each visible value row widened once per group.
template <int ND>
void weigh_values(const Task& a, const float* e, int64_t eh, int64_t et, const float* total) {
  constexpr int HB = 30 / (ND + 1);
  static_assert(HB >= 1 && HB <= 6, "weigh_values: a group's head count is dispatched up to 6");
  const int64_t G = a.G, groups = (G + HB - 1) / HB, per = (G + groups - 1) / groups;
  for (int64_t h0 = 0; h0 < G; h0 += per) {
    const int64_t hb = G - h0 < per ? G - h0 : per;
    if (a.bf16)
      weigh_group<ND, HB, true>(a, e, eh, et, total, h0, hb);
    else
      weigh_group<ND, HB, false>(a, e, eh, et, total, h0, hb);
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
