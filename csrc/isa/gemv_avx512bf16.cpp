// gemv block kernel for bf16 activations times bf16 weights, ISA level "avx512bf16" (and amx):
// vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 fp32 sums, so the weights need no
// widening. Widening them (the avx512 level's kernel) was compute-bound on a Zen 4 EPYC:
// 20 GB/s at one row where fp32 weights streamed at 28.
#include <immintrin.h>

#include "../gemv_common.h"

namespace ragfast {
namespace gemv_common {
namespace {

// Bytes ahead in the weight stream that each step prefetches.
constexpr int64_t kAhead = 2048;

// One weight row, read front to back as one stream with 4 sums along the depth (128 elements a
// step), against MM rows of x. Streaming whole rows matters: 4 rows read side by side (a
// register tile) ran at 12.5 GB/s on one Zen 4 core where one stream reached 19.
template <int MM>
void row_stream(const uint16_t* x, int64_t K, const uint16_t* row, float* y, int64_t ldy) {
  __m512 acc[MM][4];
  for (int m = 0; m < MM; ++m)
    for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    // The rows lie back to back: ask for the stream's lines kAhead bytes on (as gemv_avx512.cpp).
    for (int c = 0; c < 256; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + k) + c + kAhead, _MM_HINT_T0);
    __m512i wv[4];
    for (int u = 0; u < 4; ++u) wv[u] = _mm512_loadu_si512(row + k + 32 * u);
    for (int m = 0; m < MM; ++m)
      for (int u = 0; u < 4; ++u)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u), (__m512bh)wv[u]);
  }
  for (; k < K; k += 32) {  // the last K % 128: 32 at a time, masked at the end (zeros add nothing)
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : __mmask32((uint64_t(1) << (K - k)) - 1u);
    const __m512i wv = _mm512_maskz_loadu_epi16(mask, row + k);
    for (int m = 0; m < MM; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k), (__m512bh)wv);
  }
  for (int m = 0; m < MM; ++m)
    y[m * ldy] = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
}

}  // namespace

void gemv_block_bf16_avx512bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t ldw, int64_t n0,
                                int64_t n1, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * ldw;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_stream<4>(x + m * K, K, row, y + m * ldy + n, ldy);
    switch (M - m) {
      case 3: row_stream<3>(x + m * K, K, row, y + m * ldy + n, ldy); break;
      case 2: row_stream<2>(x + m * K, K, row, y + m * ldy + n, ldy); break;
      case 1: row_stream<1>(x + m * K, K, row, y + m * ldy + n, ldy); break;
      default: break;
    }
  }
}

}  // namespace gemv_common
}  // namespace ragfast
