// bootstrap_means tile kernel, ISA level "avx512" (-mavx512f..., set for this file in CMake;
// also used by the avx512bf16 level, which needs nothing more here).
#include <immintrin.h>

#include "../policy_common.h"

namespace ragfast {
namespace policy_common {

void tile_kernel_avx512(const double* CT, const double* DT, int64_t n, int64_t Kp, int64_t k0, double* acc) {
  __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
          a9 = a0, a10 = a0, a11 = a0;
  for (int64_t i = 0; i < n; ++i) {
    const __m512d c = _mm512_loadu_pd(CT + i * kRB);
    const double* d = DT + i * Kp + k0;
    a0 = _mm512_fmadd_pd(_mm512_set1_pd(d[0]), c, a0);
    a1 = _mm512_fmadd_pd(_mm512_set1_pd(d[1]), c, a1);
    a2 = _mm512_fmadd_pd(_mm512_set1_pd(d[2]), c, a2);
    a3 = _mm512_fmadd_pd(_mm512_set1_pd(d[3]), c, a3);
    a4 = _mm512_fmadd_pd(_mm512_set1_pd(d[4]), c, a4);
    a5 = _mm512_fmadd_pd(_mm512_set1_pd(d[5]), c, a5);
    a6 = _mm512_fmadd_pd(_mm512_set1_pd(d[6]), c, a6);
    a7 = _mm512_fmadd_pd(_mm512_set1_pd(d[7]), c, a7);
    a8 = _mm512_fmadd_pd(_mm512_set1_pd(d[8]), c, a8);
    a9 = _mm512_fmadd_pd(_mm512_set1_pd(d[9]), c, a9);
    a10 = _mm512_fmadd_pd(_mm512_set1_pd(d[10]), c, a10);
    a11 = _mm512_fmadd_pd(_mm512_set1_pd(d[11]), c, a11);
  }
  _mm512_storeu_pd(acc + 0 * kRB, a0);
  _mm512_storeu_pd(acc + 1 * kRB, a1);
  _mm512_storeu_pd(acc + 2 * kRB, a2);
  _mm512_storeu_pd(acc + 3 * kRB, a3);
  _mm512_storeu_pd(acc + 4 * kRB, a4);
  _mm512_storeu_pd(acc + 5 * kRB, a5);
  _mm512_storeu_pd(acc + 6 * kRB, a6);
  _mm512_storeu_pd(acc + 7 * kRB, a7);
  _mm512_storeu_pd(acc + 8 * kRB, a8);
  _mm512_storeu_pd(acc + 9 * kRB, a9);
  _mm512_storeu_pd(acc + 10 * kRB, a10);
  _mm512_storeu_pd(acc + 11 * kRB, a11);
}

}  // namespace policy_common
}  // namespace ragfast
