// rms_norm row kernel, ISA level "avx512" (flags set for this file in CMake); every level above it
// runs this one too. 16 fp32 lanes: the sum of squares in four running vectors, then the row
// scaled, rounded to bf16 (nearest even) where the input is bf16, times the weight, rounded again.
#include <immintrin.h>

#include <cmath>

#include "../rms_norm_common.h"

namespace ragfast {
namespace rms_norm_common {
namespace {

inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

template <bool BF16>
inline __m512 load16(const void* p, int64_t i, __mmask16 m) {
  if (!BF16) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 bits in the low half of each lane (nearest even, NaN kept quiet).
inline __m512i to_bf16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
}

// x rounded to bf16 and widened back.
inline __m512 round_bf16(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(to_bf16(x), 16)); }

template <bool BF16>
void row(const void* x, const void* w, void* y, int64_t n, float eps) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int u = 0; u < 4; ++u) {
      const __m512 v = load16<BF16>(x, i + 16 * u, 0xffff);
      a[u] = _mm512_fmadd_ps(v, v, a[u]);
    }
  for (; i < n; i += 16) {
    const __m512 v = load16<BF16>(x, i, lanes(n - i));
    a[0] = _mm512_fmadd_ps(v, v, a[0]);
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(ss / float(n) + eps));
  for (i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    __m512 t = _mm512_mul_ps(load16<BF16>(x, i, k), inv);
    if (BF16) {
      t = _mm512_mul_ps(load16<true>(w, i, k), round_bf16(t));
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i, k, _mm512_cvtepi32_epi16(to_bf16(t)));
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(y) + i, k, _mm512_mul_ps(load16<false>(w, i, k), t));
    }
  }
}

}  // namespace

void rms_norm_row_avx512(const void* x, const void* w, void* y, int64_t n, float eps, bool bf16) {
  if (bf16)
    row<true>(x, w, y, n, eps);
  else
    row<false>(x, w, y, n, eps);
}

}  // namespace rms_norm_common
}  // namespace ragfast
