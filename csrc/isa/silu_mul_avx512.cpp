// silu_mul row kernel, ISA level "avx512" (flags set for this file in CMake); every level above it
// runs this one too. 16 fp32 lanes: silu(g) by a vector exponential and a refined reciprocal,
// rounded to bf16 (nearest even) where the inputs are bf16, times up, rounded again.
#include <immintrin.h>

#include "../silu_mul_common.h"
#include "avx512_vec.h"

namespace ragfast {
namespace silu_mul_common {
namespace {

using namespace ragfast::avx512_vec;

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

template <bool BF16>
void row(const void* g, const void* u, void* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    __m512 s = silu16(load16(g, i, k, BF16));
    if (BF16) s = round_bf16(s);  // torch rounds the activation to the dtype before the product
    store16(y, i, _mm512_mul_ps(s, load16(u, i, k, BF16)), k, BF16);
  }
}

}  // namespace

void silu_mul_row_avx512(const void* g, const void* u, void* y, int64_t n, bool bf16) {
  if (bf16)
    row<true>(g, u, y, n);
  else
    row<false>(g, u, y, n);
}

}  // namespace silu_mul_common
}  // namespace ragfast
