// w8a8 row kernels, ISA level "avx512" (flags set for this file in CMake); every level above it
// runs these too. The portable rows of csrc/w8a8.cpp 16 lanes at a time, with the same
// operations in the same order: the explicitly rounded intrinsics keep the compiler from fusing a
// multiply and an add (an FMA would round once where torch's expressions round twice).
#include <immintrin.h>

#include <cstring>

#include "../w8a8_common.h"
#include "avx512_vec.h"

namespace ragfast {
namespace w8a8_common {
namespace {

using namespace ragfast::avx512_vec;  // lanes, load16, round_bf16, store16, silu16

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// 16 int32 sums from element i to floats: float(acc) * s * ws (two roundings, as torch's expression).
inline __m512 scaled16(const int32_t* acc, int64_t i, __mmask16 m, __m512 s, const float* ws) {
  const __m512 v = _mm512_mul_round_ps(_mm512_cvt_roundepi32_ps(_mm512_maskz_loadu_epi32(m, acc + i), kRound), s, kRound);
  return _mm512_mul_round_ps(v, _mm512_maskz_loadu_ps(m, ws + i), kRound);
}

}  // namespace

void w8a8_quantize_row_avx512(const void* x, bool bf16, int64_t K, int8_t* codes, float* scale) {
  // max |x| over sign-cleared bit patterns, as the portable row does
  const __m512i clear = _mm512_set1_epi32(0x7fffffff);
  __m512i top = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = lanes(K - k);
    top = _mm512_mask_max_epu32(top, m, top, _mm512_and_si512(_mm512_castps_si512(load16(x, k, m, bf16)), clear));
  }
  const uint32_t t = _mm512_reduce_max_epu32(top);
  float amax;
  std::memcpy(&amax, &t, 4);
  const float s = amax > 0.f ? amax / 127.0f : 1.0f;
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s), magic = _mm512_set1_ps(12582912.0f);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = lanes(K - k);
    __m512 q = _mm512_div_round_ps(load16(x, k, m, bf16), sv, kRound);
    q = _mm512_sub_round_ps(_mm512_add_round_ps(q, magic, kRound), magic, kRound);  // round half to even
    q = _mm512_min_ps(hi, _mm512_max_ps(lo, q));
    _mm_mask_storeu_epi8(codes + k, m, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
  }
}

void w8a8_dequantize_row_avx512(const int32_t* acc, int64_t N, float s, const float* ws, const float* bias, void* y,
                                bool bf16) {
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 m = lanes(N - n);
    __m512 v = scaled16(acc, n, m, sv, ws);
    if (bias) v = _mm512_add_round_ps(v, _mm512_maskz_loadu_ps(m, bias + n), kRound);
    store16(y, n, v, m, bf16);  // bf16: nearest even, a NaN stays a (quiet) NaN
  }
}

void w8a8_silu_mul_row_avx512(const int32_t* acc, int64_t half, float s, const float* ws, void* y, bool bf16) {
  // The gate's and the up projection's outputs as w8a8_dequantize_row_avx512 writes them (rounded
  // to bf16 when bf16), then silu_mul's row (csrc/isa/silu_mul_avx512.cpp): the same bits as the
  // two dequantised products followed by the silu_mul kernel.
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t n = 0; n < half; n += 16) {
    const __mmask16 m = lanes(half - n);
    __m512 g = scaled16(acc, n, m, sv, ws), u = scaled16(acc + half, n, m, sv, ws + half);
    if (bf16) g = round_bf16(g), u = round_bf16(u);
    __m512 a = silu16(g);
    if (bf16) a = round_bf16(a);
    store16(y, n, _mm512_mul_ps(a, u), m, bf16);
  }
}

}  // namespace w8a8_common
}  // namespace ragfast
