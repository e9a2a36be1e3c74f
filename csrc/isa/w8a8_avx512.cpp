// w8a8 row kernels, ISA level "avx512" (flags set for this file in CMake); every level above it
// runs these too. The portable rows of csrc/w8a8.cpp 16 lanes at a time, with the same
// operations in the same order: the explicitly rounded intrinsics keep the compiler from fusing a
// multiply and an add (an FMA would round once where torch's expressions round twice).
#include <immintrin.h>

#include <cstring>

#include "../w8a8_common.h"

namespace ragfast {
namespace w8a8_common {
namespace {

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

inline __m512 load16(const void* p, int64_t i, __mmask16 m, bool bf16) {
  if (!bf16) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x40);
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 m = lanes(N - n);
    __m512 v = _mm512_cvt_roundepi32_ps(_mm512_maskz_loadu_epi32(m, acc + n), kRound);
    v = _mm512_mul_round_ps(v, sv, kRound);
    v = _mm512_mul_round_ps(v, _mm512_maskz_loadu_ps(m, ws + n), kRound);
    if (bias) v = _mm512_add_round_ps(v, _mm512_maskz_loadu_ps(m, bias + n), kRound);
    if (!bf16) {
      _mm512_mask_storeu_ps(static_cast<float*>(y) + n, m, v);
      continue;
    }
    // round to nearest even; a NaN stays a (quiet) NaN
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, half), odd), 16);
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_srli_epi32(b, 16), quiet);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + n, m, _mm512_cvtepi32_epi16(r));
  }
}

}  // namespace w8a8_common
}  // namespace ragfast
