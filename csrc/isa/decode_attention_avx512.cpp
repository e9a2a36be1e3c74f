// decode_attention task kernel, ISA level "avx512" (flags set for this file in CMake); every level
// above it runs this one too. The three passes of csrc/decode_attention.cpp's portable task with
// 16 fp32 lanes: each key row is widened once (bf16 by a shift) into at most 16 registers and
// dotted with the G scaled queries; the softmax's exponentials are a vector polynomial; each value
// row is widened once and added into the G output rows.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "../decode_attention_common.h"

namespace ragfast {
namespace decode_attention_common {
namespace {

inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

// 16 values from element i, widened to fp32; lanes outside `m` read as 0.
inline __m512 load16(const void* p, int64_t i, __mmask16 m, bool bf16) {
  if (!bf16) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 fp32 stored at element i (lanes in `m`), rounded to bf16 (nearest even, NaN kept quiet) when bf16.
inline void store16(void* p, int64_t i, __m512 x, __mmask16 m, bool bf16) {
  if (!bf16) {
    _mm512_mask_storeu_ps(static_cast<float*>(p) + i, m, x);
    return;
  }
  const __m512i b = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, m, _mm512_cvtepi32_epi16(r));
}

// e^x for x <= 0 (a softmax's shifted scores) in fp32: x = n ln2 + r, |r| <= ln2 / 2, e^r by the
// Cephes expf polynomial (relative error about 1e-7), times 2^n by scalef; -inf gives 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-103.f);  // e^-103 is below the smallest denormal
  const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_scalef_ps(p, n));
}

}  // namespace

void decode_attention_task_avx512(const Task& a) {
  const int64_t G = a.G, T = a.T, D = a.D, nd = (D + 15) / 16, Dp = nd * 16, Tp = (T + 15) / 16 * 16;
  float* qs = a.scratch;
  float* acc = qs + G * Dp;
  float* s = acc + G * Dp;
  float* mx = s + G * Tp;
  float* sum = mx + G;
  const float ninf = -INFINITY;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t h = 0; h < G; ++h) {
    const void* qh = static_cast<const char*>(a.q) + size_t(h * a.q_sh) * (a.bf16 ? 2 : 4);
    for (int64_t c = 0; c < nd; ++c) {
      _mm512_storeu_ps(qs + h * Dp + 16 * c, _mm512_mul_ps(load16(qh, 16 * c, lanes(D - 16 * c), a.bf16), scale));
      _mm512_storeu_ps(acc + h * Dp + 16 * c, _mm512_setzero_ps());
    }
    mx[h] = ninf;
  }
  const size_t w = a.bf16 ? 2 : 4;
  // Pass 1: scores. One key row in registers (at most 16 x 16 lanes: D <= 256), G dot products.
  __m512 kr[16];
  for (int64_t t = 0; t < T; ++t) {
    if (a.mask && !a.mask[t]) {
      for (int64_t h = 0; h < G; ++h) s[h * Tp + t] = ninf;
      continue;
    }
    const void* kt = static_cast<const char*>(a.k) + size_t(t * a.k_st) * w;
    for (int64_t c = 0; c < nd; ++c) kr[c] = load16(kt, 16 * c, lanes(D - 16 * c), a.bf16);
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qs + h * Dp;
      __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(qh), kr[0]);
      __m512 x1 = _mm512_setzero_ps();
      int64_t c = 1;
      for (; c + 1 < nd; c += 2) {
        x0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kr[c], x0);
        x1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c + 16), kr[c + 1], x1);
      }
      if (c < nd) x0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kr[c], x0);
      const float x = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
      s[h * Tp + t] = x;
      mx[h] = x > mx[h] ? x : mx[h];
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
  // Pass 3: the values, each row widened once and added into the G output rows.
  __m512 vr[16];
  for (int64_t t = 0; t < T; ++t) {
    if (a.mask && !a.mask[t]) continue;
    const void* vt = static_cast<const char*>(a.v) + size_t(t * a.v_st) * w;
    for (int64_t c = 0; c < nd; ++c) vr[c] = load16(vt, 16 * c, lanes(D - 16 * c), a.bf16);
    for (int64_t h = 0; h < G; ++h) {
      const __m512 p = _mm512_set1_ps(s[h * Tp + t]);
      float* ah = acc + h * Dp;
      for (int64_t c = 0; c < nd; ++c)
        _mm512_storeu_ps(ah + 16 * c, _mm512_fmadd_ps(p, vr[c], _mm512_loadu_ps(ah + 16 * c)));
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    const __m512 inv = _mm512_set1_ps(sum[h] > 0.f ? 1.f / sum[h] : 0.f);  // no visible key: zeros
    void* oh = static_cast<char*>(a.out) + size_t(h * a.o_sh) * w;
    for (int64_t c = 0; c < nd; ++c)
      store16(oh, 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + h * Dp + 16 * c), inv), lanes(D - 16 * c), a.bf16);
  }
}

}  // namespace decode_attention_common
}  // namespace ragfast
