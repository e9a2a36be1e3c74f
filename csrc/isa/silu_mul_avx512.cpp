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
