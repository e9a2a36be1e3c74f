// decode_attention task kernel, ISA level "avx512" (flags set for this file in CMake); every level
// above it runs this one too. The three passes of csrc/decode_attention.cpp's portable task with
// 16 fp32 lanes: keys 16 at a time, each row widened once (bf16 by a shift) and dotted with the G
// scaled queries, a head's 16 partial-sum vectors summed by one transpose-and-add tree; the
// softmax's exponentials by a vector polynomial; the values with the heads' sums in registers
// (head dims 64 and 128; any other D <= 256 adds into sums kept in memory).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "../decode_attention_common.h"
#include "avx512_vec.h"
#include "decode_attention_values.h"

namespace ragfast {
namespace decode_attention_common {
namespace {

using namespace ragfast::avx512_vec;  // lanes, load16, store16, exp16

// r[j] = the sum of v[j]'s 16 lanes, for j < 16: a transpose-and-add tree (45 shuffles and adds,
// where 16 horizontal sums take about 130).
inline __m512 sum16(const __m512* v) {
  __m512 a[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 c[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v4i .. v4i+3
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // add the four 128-bit lanes: block i of the result is c[i]'s lanes summed
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

}  // namespace

void decode_attention_task_avx512(const Task& a) {
  const int64_t G = a.G, T = a.T, D = a.D, nd = (D + 15) / 16, Dp = nd * 16, Tp = (T + 15) / 16 * 16;
  float* qs = a.scratch;
  float* acc = qs + G * Dp;
  float* s = acc + G * Dp;
  float* mx = s + G * Tp;
  float* sum = mx + G;
  float* kb = sum + G;  // 16 key rows widened to fp32, [16][Dp]
  const float ninf = -INFINITY;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t h = 0; h < G; ++h) {
    const void* qh = static_cast<const char*>(a.q) + size_t(h * a.q_sh) * (a.bf16 ? 2 : 4);
    for (int64_t c = 0; c < nd; ++c)
      _mm512_storeu_ps(qs + h * Dp + 16 * c, _mm512_mul_ps(load16(qh, 16 * c, lanes(D - 16 * c), a.bf16), scale));
    mx[h] = ninf;
  }
  const size_t w = a.bf16 ? 2 : 4;
  // Pass 1: scores, 16 keys at a time. The block's visible rows are widened once into kb; each head
  // dots its query with the 16 rows (16 vectors of partial sums) and sums them with one tree.
  const __m512 vninf = _mm512_set1_ps(ninf);
  for (int64_t t0 = 0; t0 < T; t0 += 16) {
    for (int64_t j = t0; j < t0 + 16 && j < T; ++j)  // the next task's values, a row per key
      prefetch_next(a.next_v, j, a.v_st * int64_t(w), D * int64_t(w));
    __mmask16 on = lanes(T - t0);
    if (a.mask) on &= _mm_mask_cmpneq_epi8_mask(on, _mm_maskz_loadu_epi8(on, a.mask + t0), _mm_setzero_si128());
    for (int j = 0; j < 16; ++j) {
      float* kj = kb + j * Dp;
      if (!((on >> j) & 1)) {  // not read: zeros, so its lane's sum is a number (then masked)
        for (int64_t c = 0; c < nd; ++c) _mm512_storeu_ps(kj + 16 * c, _mm512_setzero_ps());
        continue;
      }
      const void* kt = static_cast<const char*>(a.k) + size_t((t0 + j) * a.k_st) * w;
      for (int64_t c = 0; c < nd; ++c) _mm512_storeu_ps(kj + 16 * c, load16(kt, 16 * c, lanes(D - 16 * c), a.bf16));
    }
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qs + h * Dp;
      __m512 v[16];
      const __m512 q0 = _mm512_loadu_ps(qh);
      for (int j = 0; j < 16; ++j) v[j] = _mm512_mul_ps(q0, _mm512_loadu_ps(kb + j * Dp));
      for (int64_t c = 1; c < nd; ++c) {
        const __m512 qc = _mm512_loadu_ps(qh + 16 * c);
        for (int j = 0; j < 16; ++j) v[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kb + j * Dp + 16 * c), v[j]);
      }
      const __m512 r = _mm512_mask_blend_ps(on, vninf, sum16(v));  // masked keys: -inf
      _mm512_storeu_ps(s + h * Tp + t0, r);
      const float m = _mm512_reduce_max_ps(r);
      mx[h] = m > mx[h] ? m : mx[h];
    }
  }
  // Pass 2: e^(s - max) in place, and their sums (masked keys hold -inf: 0).
  for (int64_t h = 0; h < G; ++h) {
    float* sh = s + h * Tp;
    __m512 tot = _mm512_setzero_ps();
    if (mx[h] != ninf) {
      const __m512 m = _mm512_set1_ps(mx[h]);
      for (int64_t t = 0; t < T; t += 16) {
        const __mmask16 k = lanes(T - t);
        const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + t), m)));
        _mm512_mask_storeu_ps(sh + t, k, e);
        tot = _mm512_add_ps(tot, e);
      }
    }
    sum[h] = _mm512_reduce_add_ps(tot);
  }
  // Pass 3: the values, weighted by the exponentials, then divided by their sums.
  switch (nd) {
    case 4: return weigh_values<4>(a, s, Tp, 1, sum);
    case 8: return weigh_values<8>(a, s, Tp, 1, sum);
    default: return weigh_values_any(a, s, Tp, 1, sum, acc, nd, Dp);
  }
}

}  // namespace decode_attention_common
}  // namespace ragfast
