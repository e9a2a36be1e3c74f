// gemv block kernel, ISA level "avx2" (-mavx2 -mfma -mf16c, set for this file in CMake).
#include <immintrin.h>

#include "../gemv_common.h"

namespace ragfast {
namespace gemv_common {
namespace {

// 8 weights of row `p` from element k, widened to fp32.
template <int KIND>
inline __m256 load_w(const void* p, int64_t k) {
  if (KIND == kF32) return _mm256_loadu_ps(static_cast<const float*>(p) + k);
  if (KIND == kBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(p) + k));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

template <int KIND>
inline float scalar_w(const void* p, int64_t k) {
  if (KIND == kF32) return static_cast<const float*>(p)[k];
  if (KIND == kBF16) {
    const uint32_t b = uint32_t(static_cast<const uint16_t*>(p)[k]) << 16;
    float f;
    __builtin_memcpy(&f, &b, 4);
    return f;
  }
  return float(static_cast<const int8_t*>(p)[k]);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Bytes ahead in the weight stream that each step prefetches.
constexpr int64_t kAhead = 2048;

// One weight row, read front to back as one stream with 4 sums along the depth (32 elements a
// step), against MM rows of x (see csrc/isa/gemv_avx512bf16.cpp for why whole rows); the depth's
// last K % 8 in scalar.
template <int KIND, int MM>
void row_stream(const float* x, int64_t K, const void* row, float* y, int64_t ldy) {
  __m256 acc[MM][4];
  for (int m = 0; m < MM; ++m)
    for (int u = 0; u < 4; ++u) acc[m][u] = _mm256_setzero_ps();
  constexpr int64_t width = KIND == kF32 ? 4 : KIND == kBF16 ? 2 : 1;
  const char* bytes = static_cast<const char*>(row);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    // The rows lie back to back: ask for the stream's lines kAhead bytes on (as gemv_avx512.cpp).
    for (int64_t c = 0; c < 32 * width; c += 64) _mm_prefetch(bytes + k * width + c + kAhead, _MM_HINT_T0);
    __m256 wv[4];
    for (int u = 0; u < 4; ++u) wv[u] = load_w<KIND>(row, k + 8 * u);
    for (int m = 0; m < MM; ++m)
      for (int u = 0; u < 4; ++u) acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * u), wv[u], acc[m][u]);
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = load_w<KIND>(row, k);
    for (int m = 0; m < MM; ++m) acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[m][0]);
  }
  for (int m = 0; m < MM; ++m) {
    float s = hsum(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
    for (int64_t j = k; j < K; ++j) s += x[m * K + j] * scalar_w<KIND>(row, j);
    y[m * ldy] = s;
  }
}

template <int KIND>
void block(const float* x, int64_t M, int64_t K, const void* w, int64_t ldw, int64_t n0, int64_t n1, float* y,
           int64_t ldy) {
  const int64_t row_bytes = ldw * (KIND == kF32 ? 4 : KIND == kBF16 ? 2 : 1);
  for (int64_t n = n0; n < n1; ++n) {
    const void* row = static_cast<const char*>(w) + n * row_bytes;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) row_stream<KIND, 2>(x + m * K, K, row, y + m * ldy + n, ldy);
    if (m < M) row_stream<KIND, 1>(x + m * K, K, row, y + m * ldy + n, ldy);
  }
}

}  // namespace

void gemv_block_avx2(const float* x, int64_t M, int64_t K, const void* w, int kind, int64_t ldw, int64_t n0,
                     int64_t n1, float* y, int64_t ldy) {
  switch (kind) {
    case kF32: return block<kF32>(x, M, K, w, ldw, n0, n1, y, ldy);
    case kBF16: return block<kBF16>(x, M, K, w, ldw, n0, n1, y, ldy);
    default: return block<kI8>(x, M, K, w, ldw, n0, n1, y, ldy);
  }
}

}  // namespace gemv_common
}  // namespace ragfast
