// argmax row kernel, ISA level "avx512" (flags set for this file in CMake); every level above it
// runs this one too.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "../argmax_common.h"

namespace ragfast {
namespace argmax_common {
namespace {

// 16 values from element i, widened to fp32 (bf16 by a shift); lanes outside `mask` read as 0.
template <bool BF16>
inline __m512 load16(const void* p, int64_t i, __mmask16 mask) {
  if (!BF16) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <bool BF16>
int64_t first_nan(const void* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float f;
    if (BF16) {
      const uint32_t b = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
      std::memcpy(&f, &b, 4);
    } else {
      f = static_cast<const float*>(p)[i];
    }
    if (std::isnan(f)) return i;
  }
  return -1;  // not reached: called only when pass 1 saw a NaN
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

template <bool BF16>
int64_t row(const void* p, int64_t n) {
  // Pass 1: the largest value (4 running maxima, 64 values a step) and whether a NaN is there.
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 a[4] = {ninf, ninf, ninf, ninf};
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int u = 0; u < 4; ++u) {
      const __m512 v = load16<BF16>(p, i + 16 * u, 0xffff);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      a[u] = _mm512_max_ps(a[u], v);
    }
  for (; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 v = load16<BF16>(p, i, k);
    nan |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
    a[0] = _mm512_mask_max_ps(a[0], k, a[0], v);  // lanes past the row keep their maximum
  }
  if (nan) return first_nan<BF16>(p, n);
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a[0], a[1]), _mm512_max_ps(a[2], a[3]))));
  // Pass 2: its first position (equal compares -0 and +0 alike, as torch's > does).
  for (i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __mmask16 eq = _mm512_mask_cmp_ps_mask(k, load16<BF16>(p, i, k), m, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(unsigned(eq));
  }
  return 0;  // not reached: the maximum is in the row
}

}  // namespace

int64_t argmax_row_avx512(const void* p, int64_t n, bool bf16) { return bf16 ? row<true>(p, n) : row<false>(p, n); }

}  // namespace argmax_common
}  // namespace ragfast
