// gemv for int8 weights times bf16 activations, ISA level "avx512vnni" (avx512bf16 and amx run it
// too): the weight bytes go into vpdpbusd as they are, with no widening.
//
// Why: the avx512 level widens each int8 weight to fp32 (a sign extension and a conversion per 16
// weights, then an FMA per row of x), and at one or two rows that arithmetic, not memory, set the
// pace: 2.25x the read floor on a Zen 4 EPYC where bf16 weights ran at 1.4x.
//
// How: each row of x is rounded once per call to a 23-bit fixed point, q = round(x / s) with
// s = max|x| / QMAX, and q is split into three signed bytes, q = hi * 65536 + mid * 256 + lo (each
// part in [-128, 127]). vpdpbusd multiplies unsigned bytes by signed bytes: the weights go in as the
// unsigned operand with their sign bit flipped (w + 128), a part as the signed one, so each lane
// sums w * part + 128 * part; the 128 * part sums (one vector per row and part, made once per call)
// start the accumulators negated, and the lanes hold exact int32 sums of w * part. The three parts'
// lanes are combined in fp32 (exact while a lane stays under 2^24: depths up to 16,384) and summed.
// The rounding of x costs at most s / 2 per element, about max|x| / 2^24: 2^16 times less than a
// bf16 activation's own rounding near max|x|.
#include <immintrin.h>

#include <cstring>

#include "../gemv_common.h"

namespace ragfast {
namespace gemv_common {
namespace {

constexpr int32_t kQMax = I8Parts::kQMax;
constexpr int64_t kAhead = 2048;  // bytes ahead in the weight stream that each step prefetches

// acc += u (unsigned bytes) . s (signed bytes), by quads; inline assembly keeps every accumulator
// in its register (as csrc/isa/w8a8_avx512vnni.cpp, where GCC's intrinsic spilled them).
inline void dpbusd(__m512i& acc, __m512i u, __m512i s) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s)); }

inline __m512 widen_bf16(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

inline __mmask16 mask16(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

// The signed byte of the balanced base-256 split: ((v + 128) mod 256) - 128.
inline __m512i low_byte(__m512i v) {
  const __m512i c128 = _mm512_set1_epi32(128);
  return _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), _mm512_set1_epi32(255)), c128);
}

// One weight row against MM rows of x: U groups of 64 bytes a step, 3 parts per row each with its
// own accumulator, so a step has 3 * MM * U independent vpdpbusd chains.
template <int MM, int U>
void row_stream(const I8Parts& xp, int64_t m0, const int8_t* row, int64_t K, float* y, int64_t ldy) {
  __m512i acc[MM][3][U];
#pragma GCC unroll 4
  for (int m = 0; m < MM; ++m)
#pragma GCC unroll 3
    for (int p = 0; p < 3; ++p) {
      acc[m][p][0] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                      _mm512_loadu_si512(xp.corr + ((m0 + m) * 3 + p) * 16));
#pragma GCC unroll 2
      for (int u = 1; u < U; ++u) acc[m][p][u] = _mm512_setzero_si512();
    }
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t Kp = xp.Kp;
  int64_t k = 0;
  for (; k + 64 * U <= K; k += 64 * U) {
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k + 64 * u) + kAhead, _MM_HINT_T0);
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(row + k + 64 * u), flip);
#pragma GCC unroll 4
      for (int m = 0; m < MM; ++m)
#pragma GCC unroll 3
        for (int p = 0; p < 3; ++p)
          dpbusd(acc[m][p][u], w, _mm512_loadu_si512(xp.parts + ((m0 + m) * 3 + p) * Kp + k + 64 * u));
    }
  }
  // The rest, 64 at a time: weights past K load as 0 (128 once flipped) against parts that are 0
  // there (the parts are padded to Kp with zeros), so they add nothing.
  for (; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1u;
    const __m512i w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, row + k), flip);
#pragma GCC unroll 4
    for (int m = 0; m < MM; ++m)
#pragma GCC unroll 3
      for (int p = 0; p < 3; ++p)
        dpbusd(acc[m][p][0], w, _mm512_loadu_si512(xp.parts + ((m0 + m) * 3 + p) * Kp + k));
  }
#pragma GCC unroll 4
  for (int m = 0; m < MM; ++m) {
    __m512i s[3];
#pragma GCC unroll 3
    for (int p = 0; p < 3; ++p) {
      s[p] = acc[m][p][0];
#pragma GCC unroll 2
      for (int u = 1; u < U; ++u) s[p] = _mm512_add_epi32(s[p], acc[m][p][u]);
    }
    const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_set1_ps(65536.f),
                                     _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[1]), _mm512_set1_ps(256.f),
                                                     _mm512_cvtepi32_ps(s[2])));
    y[m * ldy] = _mm512_reduce_add_ps(f) * xp.scale[m0 + m];
  }
}

// Column group of the packed layout against MM rows of x: one 64-byte row of codes a depth quad
// (16 output rows' quads), each x part's quad broadcast, so the 16 lanes end as the 16 outputs'
// sums: no horizontal sum, and the codes stream front to back (a 2-core Zen 4 EPYC read them at
// the rate of a plain read loop, where the row-major block above ran at 0.6-0.7x of it).
template <int MM>
void group_stream(const I8Parts& xp, int64_t m0, const int8_t* b, float* y, int64_t ldy) {
  __m512i acc[MM][3];
#pragma GCC unroll 4
  for (int m = 0; m < MM; ++m)
#pragma GCC unroll 3
    for (int p = 0; p < 3; ++p)  // every lane sums the whole depth: 128 x the part's whole sum to take off
      acc[m][p] = _mm512_set1_epi32(-_mm512_reduce_add_epi32(_mm512_loadu_si512(xp.corr + ((m0 + m) * 3 + p) * 16)));
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t Kp = xp.Kp;
  for (int64_t r = 0; r < xp.K / 4; ++r) {
    const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(b + r * 64), flip);
#pragma GCC unroll 4
    for (int m = 0; m < MM; ++m)
#pragma GCC unroll 3
      for (int p = 0; p < 3; ++p) {
        int32_t quad;
        std::memcpy(&quad, xp.parts + ((m0 + m) * 3 + p) * Kp + 4 * r, 4);
        dpbusd(acc[m][p], w, _mm512_set1_epi32(quad));
      }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MM; ++m) {
    // A whole-depth sum can pass 2^24 (127 x 127 x K), so the conversion rounds: by 2^-24 of it.
    const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][0]), _mm512_set1_ps(65536.f),
                                     _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][1]), _mm512_set1_ps(256.f),
                                                     _mm512_cvtepi32_ps(acc[m][2])));
    _mm512_storeu_ps(y + m * ldy, _mm512_mul_ps(f, _mm512_set1_ps(xp.scale[m0 + m])));
  }
}

}  // namespace

bool gemv_i8_prepare_avx512vnni(const uint16_t* x, int64_t ldx, I8Parts& xp) {
  const int64_t M = xp.M, K = xp.K, Kp = xp.Kp;
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* src = x + m * ldx;
    __m512 mx = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = widen_bf16(src + k, mask16(K - k));
      bad |= _mm512_fpclass_ps_mask(v, 0x01 | 0x08 | 0x10 | 0x80);  // NaN, +inf, -inf
      mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    }
    if (bad) return false;  // the fp32 path carries NaN and infinity as the reference does
    const float maxabs = _mm512_reduce_max_ps(mx);
    xp.scale[m] = maxabs / float(kQMax);
    const __m512 inv = _mm512_set1_ps(maxabs > 0.f ? float(kQMax) / maxabs : 0.f);
    int8_t* hi = xp.parts + (m * 3 + 0) * Kp;
    int8_t* mid = xp.parts + (m * 3 + 1) * Kp;
    int8_t* lo = xp.parts + (m * 3 + 2) * Kp;
    for (int64_t k = 0; k < Kp; k += 16) {
      const __mmask16 mask = k < K ? mask16(K - k) : __mmask16(0);
      // x * inv can round one past QMAX in fp32: clamp.
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(widen_bf16(src + k, mask), inv));
      q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(kQMax)), _mm512_set1_epi32(-kQMax));
      const __m512i l = low_byte(q);
      const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(q, l), 8);
      const __m512i md = low_byte(r);
      const __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(r, md), 8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + k), _mm512_cvtepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(mid + k), _mm512_cvtepi32_epi8(md));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + k), _mm512_cvtepi32_epi8(l));
    }
    for (int p = 0; p < 3; ++p) {
      __m512i c = _mm512_setzero_si512();
      const int8_t* part = xp.parts + (m * 3 + p) * Kp;
      for (int64_t k = 0; k < Kp; k += 64) c = _mm512_dpbusd_epi32(c, c128, _mm512_loadu_si512(part + k));
      _mm512_storeu_si512(xp.corr + (m * 3 + p) * 16, c);
    }
  }
  return true;
}

void gemv_block_i8_avx512vnni(const I8Parts& xp, const int8_t* w, int64_t ldw, int64_t n0, int64_t n1, float* y,
                              int64_t ldy) {
  const int64_t M = xp.M, K = xp.K;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * ldw;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_stream<4, 1>(xp, m, row, K, y + m * ldy + n, ldy);
    switch (M - m) {
      case 3: row_stream<3, 1>(xp, m, row, K, y + m * ldy + n, ldy); break;
      case 2: row_stream<2, 2>(xp, m, row, K, y + m * ldy + n, ldy); break;
      case 1: row_stream<1, 2>(xp, m, row, K, y + m * ldy + n, ldy); break;
      default: break;
    }
  }
}

void gemv_block_i8_packed_avx512vnni(const I8Parts& xp, const int8_t* packed, int64_t g0, int64_t g1, float* y,
                                     int64_t ldy) {
  const int64_t M = xp.M, gbytes = xp.K * 16;
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* b = packed + g * gbytes;
    float* yg = y + g * 16;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) group_stream<4>(xp, m, b, yg + m * ldy, ldy);
    switch (M - m) {
      case 3: group_stream<3>(xp, m, b, yg + m * ldy, ldy); break;
      case 2: group_stream<2>(xp, m, b, yg + m * ldy, ldy); break;
      case 1: group_stream<1>(xp, m, b, yg + m * ldy, ldy); break;
      default: break;
    }
  }
}

}  // namespace gemv_common
}  // namespace ragfast
