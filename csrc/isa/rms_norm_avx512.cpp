// rms_norm row kernel, ISA level "avx512" (flags set for this file in CMake); every level above it
// runs this one too. 16 fp32 lanes: the sum of squares in four running vectors, then the row
// scaled, rounded to bf16 (nearest even) where the input is bf16, times the weight, rounded again.
#include <immintrin.h>

#include <cmath>

#include "../rms_norm_common.h"
#include "avx512_vec.h"

namespace ragfast {
namespace rms_norm_common {
namespace {

using namespace ragfast::avx512_vec;

template <bool BF16>
void row(const void* x, const void* w, void* y, int64_t n, float eps) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int u = 0; u < 4; ++u) {
      const __m512 v = load16(x, i + 16 * u, 0xffff, BF16);
      a[u] = _mm512_fmadd_ps(v, v, a[u]);
    }
  for (; i < n; i += 16) {
    const __m512 v = load16(x, i, lanes(n - i), BF16);
    a[0] = _mm512_fmadd_ps(v, v, a[0]);
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(ss / float(n) + eps));
  for (i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    __m512 t = _mm512_mul_ps(load16(x, i, k, BF16), inv);
    if (BF16) t = round_bf16(t);  // torch rounds the scaled row to the dtype before the weight
    store16(y, i, _mm512_mul_ps(load16(w, i, k, BF16), t), k, BF16);
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
