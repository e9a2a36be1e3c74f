// bootstrap_means tile kernel, ISA level "avx2" (-mavx2 -mfma, set for this file in CMake).
#include <immintrin.h>

#include "../policy_common.h"

namespace ragfast {
namespace policy_common {

// 16 ymm registers: 6 rows x 2 vectors (8 resamples) = 12 accumulators per pass, two passes.
void tile_kernel_avx2(const double* CT, const double* DT, int64_t n, int64_t Kp, int64_t k0, double* acc) {
  for (int64_t h = 0; h < kKT; h += 6) {
    __m256d a[6][2];
    for (int r = 0; r < 6; ++r) a[r][0] = a[r][1] = _mm256_setzero_pd();
    for (int64_t i = 0; i < n; ++i) {
      const __m256d c0 = _mm256_loadu_pd(CT + i * kRB), c1 = _mm256_loadu_pd(CT + i * kRB + 4);
      const double* d = DT + i * Kp + k0 + h;
      for (int r = 0; r < 6; ++r) {
        const __m256d dv = _mm256_broadcast_sd(d + r);
        a[r][0] = _mm256_fmadd_pd(dv, c0, a[r][0]);
        a[r][1] = _mm256_fmadd_pd(dv, c1, a[r][1]);
      }
    }
    for (int r = 0; r < 6; ++r) {
      _mm256_storeu_pd(acc + (h + r) * kRB, a[r][0]);
      _mm256_storeu_pd(acc + (h + r) * kRB + 4, a[r][1]);
    }
  }
}

}  // namespace policy_common
}  // namespace ragfast
