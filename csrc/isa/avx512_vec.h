// 16-lane fp32 helpers shared by the AVX-512 kernels of several ops (csrc/isa/*_avx512.cpp only:
// the functions use AVX-512 instructions, so only files compiled with that level's flags may
// include this). In an anonymous namespace: each translation unit keeps its own copy, so the
// linker never merges one into code built for another level (see csrc/topk_ip_common.h).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace ragfast {
namespace avx512_vec {
namespace {

// The first min(left, 16) lanes.
inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

// 16 values from element i (fp32, or bf16 held as uint16_t), widened to fp32; lanes outside `m` read as 0.
inline __m512 load16(const void* p, int64_t i, __mmask16 m, bool bf16) {
  if (!bf16) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x rounded to bf16 (nearest even, NaN kept quiet): the bits in each lane's low half.
inline __m512i bf16_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
}

// x rounded to bf16 and widened back to fp32.
inline __m512 round_bf16(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }

// 16 fp32 stored at element i (lanes in `m`), rounded to bf16 first when bf16.
inline void store16(void* p, int64_t i, __m512 x, __mmask16 m, bool bf16) {
  if (!bf16)
    _mm512_mask_storeu_ps(static_cast<float*>(p) + i, m, x);
  else
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, m, _mm512_cvtepi32_epi16(bf16_bits(x)));
}

// e^x for x <= 0 in fp32: x = n ln2 + r, |r| <= ln2 / 2, e^r by the Cephes expf polynomial
// (relative error about 1e-7), times 2^n by scalef (denormal results kept); 0 below e^-103, under
// the smallest denormal. A NaN gives about 0: a caller that can meet one deals with it.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-103.f);
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

// a / b for b in [1, 2]: the reciprocal estimate (14 bits) refined by one Newton step, then one
// correction of the quotient (within an ulp). The division instruction took about 50 cycles per
// 16 values here; this takes a few.
inline __m512 divide(__m512 a, __m512 b) {
  const __m512 r = _mm512_rcp14_ps(b);
  const __m512 r1 = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(b, r, _mm512_set1_ps(1.f)), r);  // r (2 - b r)
  const __m512 q = _mm512_mul_ps(a, r1);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(b, q, a), r1, q);  // q + (a - b q) / b
}

// silu(a) = a / (1 + e^-a), computed as (a >= 0 ? a : a e^a) / (1 + e^-|a|): the exponential of a
// value <= 0 never overflows and the divisor stays in [1, 2]. +-inf and NaN give torch's answers
// (inf, NaN, NaN).
inline __m512 silu16(__m512 a) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)));
  const __m512 num = _mm512_mask_mul_ps(a, _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ), a, e);
  // +-0 and +-inf go through as they are (0 / b keeps its sign; inf has e = 0, b = 1), where the
  // quotient's correction step would lose the sign or make inf - inf
  return _mm512_mask_mov_ps(divide(num, _mm512_add_ps(_mm512_set1_ps(1.f), e)), _mm512_fpclass_ps_mask(num, 0x1e), num);
}

}  // namespace
}  // namespace avx512_vec
}  // namespace ragfast
