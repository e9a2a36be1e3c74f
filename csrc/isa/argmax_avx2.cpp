// argmax row kernel, ISA level "avx2" (flags set for this file in CMake).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "../argmax_common.h"

namespace ragfast {
namespace argmax_common {
namespace {

template <bool BF16>
inline float at(const void* p, int64_t i) {
  if (!BF16) return static_cast<const float*>(p)[i];
  const uint32_t b = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// 8 values from element i (all in the row), widened to fp32 (bf16 by a shift).
template <bool BF16>
inline __m256 load8(const void* p, int64_t i) {
  if (!BF16) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <bool BF16>
int64_t row(const void* p, int64_t n) {
  // Pass 1: the largest value (4 running maxima, 32 values a step, the last n % 8 one by one)
  // and whether a NaN is there.
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 a[4] = {ninf, ninf, ninf, ninf};
  __m256 nanv = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int u = 0; u < 4; ++u) {
      const __m256 v = load8<BF16>(p, i + 8 * u);
      nanv = _mm256_or_ps(nanv, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      a[u] = _mm256_max_ps(a[u], v);
    }
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8<BF16>(p, i);
    nanv = _mm256_or_ps(nanv, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    a[0] = _mm256_max_ps(a[0], v);
  }
  const int64_t body = i;
  if (_mm256_movemask_ps(nanv))
    for (int64_t j = 0; j < body; ++j)
      if (std::isnan(at<BF16>(p, j))) return j;
  float tail = -INFINITY;
  for (; i < n; ++i) {
    const float v = at<BF16>(p, i);
    if (std::isnan(v)) return i;
    tail = v > tail ? v : tail;
  }
  __m256 v = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4e));
  v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xb1));
  float best = _mm256_cvtss_f32(v);
  best = tail > best ? tail : best;
  // Pass 2: its first position (equal compares -0 and +0 alike, as torch's > does).
  const __m256 m = _mm256_set1_ps(best);
  for (i = 0; i < body; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(load8<BF16>(p, i), m, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(unsigned(eq));
  }
  for (; i < n; ++i)
    if (at<BF16>(p, i) == best) return i;
  return 0;  // not reached: the maximum is in the row
}

}  // namespace

int64_t argmax_row_avx2(const void* p, int64_t n, bool bf16) { return bf16 ? row<true>(p, n) : row<false>(p, n); }

}  // namespace argmax_common
}  // namespace ragfast
