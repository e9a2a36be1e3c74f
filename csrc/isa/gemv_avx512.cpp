// gemv block kernel, ISA level "avx512" (flags set for this file in CMake); every level above it
// (avx512vnni, avx512bf16, amx) runs this one too: the op is bound by the weight bytes, which
// BF16 or VNNI dot products would not read faster.
#include <immintrin.h>

#include "../gemv_common.h"

namespace ragfast {
namespace gemv_common {
namespace {

// 16 weights of row `p` from element k, widened to fp32 (masked: lanes outside `mask` read as 0).
template <int KIND>
inline __m512 load_w(const void* p, int64_t k, __mmask16 mask) {
  if (KIND == kF32) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + k);
  if (KIND == kBF16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  const __m128i b = _mm_maskz_loadu_epi8(mask, static_cast<const int8_t*>(p) + k);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

// Bytes ahead in the weight stream that each step prefetches.
constexpr int64_t kAhead = 2048;

// One weight row, read front to back as one stream with 4 sums along the depth (64 elements a
// step), against MM rows of x (see csrc/isa/gemv_avx512bf16.cpp for why whole rows).
template <int KIND, int MM>
void row_stream(const float* x, int64_t K, const void* row, float* y, int64_t ldy) {
  __m512 acc[MM][4];
  for (int m = 0; m < MM; ++m)
    for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
  constexpr int64_t width = KIND == kF32 ? 4 : KIND == kBF16 ? 2 : 1;
  const char* bytes = static_cast<const char*>(row);
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    // The rows lie back to back, so the weights are one stream: ask for its lines kAhead bytes
    // on (into the next rows), which the tail of each row's loop would otherwise wait for.
    for (int64_t c = 0; c < 64 * width; c += 64) _mm_prefetch(bytes + k * width + c + kAhead, _MM_HINT_T0);
    __m512 wv[4];
    for (int u = 0; u < 4; ++u) wv[u] = load_w<KIND>(row, k + 16 * u, 0xffff);
    for (int m = 0; m < MM; ++m)
      for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16 * u), wv[u], acc[m][u]);
  }
  for (; k < K; k += 16) {  // the last K % 64: 16 at a time, masked at the end (zeros add nothing)
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1u);
    const __m512 wv = load_w<KIND>(row, k, mask);
    for (int m = 0; m < MM; ++m) acc[m][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * K + k), wv, acc[m][0]);
  }
  for (int m = 0; m < MM; ++m)
    y[m * ldy] = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
}

template <int KIND>
void block(const float* x, int64_t M, int64_t K, const void* w, int64_t ldw, int64_t n0, int64_t n1, float* y,
           int64_t ldy) {
  const int64_t row_bytes = ldw * (KIND == kF32 ? 4 : KIND == kBF16 ? 2 : 1);
  for (int64_t n = n0; n < n1; ++n) {
    const void* row = static_cast<const char*>(w) + n * row_bytes;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_stream<KIND, 4>(x + m * K, K, row, y + m * ldy + n, ldy);
    switch (M - m) {
      case 3: row_stream<KIND, 3>(x + m * K, K, row, y + m * ldy + n, ldy); break;
      case 2: row_stream<KIND, 2>(x + m * K, K, row, y + m * ldy + n, ldy); break;
      case 1: row_stream<KIND, 1>(x + m * K, K, row, y + m * ldy + n, ldy); break;
      default: break;
    }
  }
}

}  // namespace

void gemv_block_avx512(const float* x, int64_t M, int64_t K, const void* w, int kind, int64_t ldw, int64_t n0,
                       int64_t n1, float* y, int64_t ldy) {
  switch (kind) {
    case kF32: return block<kF32>(x, M, K, w, ldw, n0, n1, y, ldy);
    case kBF16: return block<kBF16>(x, M, K, w, ldw, n0, n1, y, ldy);
    default: return block<kI8>(x, M, K, w, ldw, n0, n1, y, ldy);
  }
}

}  // namespace gemv_common
}  // namespace ragfast
