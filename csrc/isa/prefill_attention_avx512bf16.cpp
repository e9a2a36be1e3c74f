// prefill_attention task kernel, ISA level "avx512bf16" (flags set for this file in CMake: Zen 4,
// Sapphire Rapids without AMX in use), for bf16 with head dims a multiple of 32 up to 128 (the
// dispatcher sends the rest to the portable task).
//
// The amx task's data flow (csrc/isa/prefill_attention_amx.cpp) with AVX512-BF16 dot products
// (vdpbf16ps: 16 lanes, each the sum of a bf16 pair's products into fp32) instead of tiles. A task
// is one (sequence, key/value head); its G heads x L queries run as rows 16 at a time, query-major
// (the G heads of a query side by side), with the block's rows in the lanes throughout:
//  1. scores: the block's queries as D / 2 vectors of depth pairs (lane r: query r's pair j), and
//     for each key its pair j broadcast, so S[t][16] gathers no data; 8 keys at a time, 8
//     independent sums;
//  2. the softmax and the exponentials as bf16 key pairs (csrc/isa/prefill_softmax.h, shared with
//     the amx task);
//  3. the values: for 16 dims at a time, out^T[d][16] += P[t pair][16 lanes of key pairs] .
//     broadcast (v[t][d], v[t + 1][d]), from a copy of V laid out once per task as key pairs.
// The exponentials enter the values' product rounded to bf16 (as the amx task and SDPA's bf16
// kernels do); their sum, which divides it, stays fp32.
#include <immintrin.h>

#include <cstring>

#include "../prefill_attention_common.h"
#include "prefill_softmax.h"

namespace ragfast {
namespace prefill_attention_common {
namespace {

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// Scores (unscaled) of NK keys from `k` (rows `ks` elements apart) against the block's queries
// (qp: D / 2 vectors of 16 depth-pair words) into S[0 .. NK)[16].
template <int NK>
void score_keys(const uint32_t* qp, const uint16_t* k, int64_t ks, int64_t D, float* S) {
  __m512 acc[NK];
#pragma GCC unroll 8
  for (int i = 0; i < NK; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < D / 2; ++j) {
    const __m512bh q = as_bh(_mm512_load_si512(qp + 16 * j));
#pragma GCC unroll 8
    for (int i = 0; i < NK; ++i) {
      uint32_t w;
      std::memcpy(&w, k + i * ks + 2 * j, 4);
      acc[i] = _mm512_dpbf16_ps(acc[i], q, as_bh(_mm512_set1_epi32(static_cast<int>(w))));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NK; ++i) _mm512_store_ps(S + i * 16, acc[i]);
}

// out^T for the 16 dims from d0 into O[d][16]: the exponentials' pair rows P times the values'
// pairs Vp[t pair][D] broadcast, over the first n32 keys.
void values16(const uint16_t* P, const uint32_t* Vp, int64_t D, int64_t n32, int64_t d0, float* O) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t tp = 0; tp < n32 / 2; ++tp) {
    const __m512bh p = as_bh(_mm512_load_si512(P + tp * 32));
    const uint32_t* v = Vp + tp * D + d0;
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], p, as_bh(_mm512_set1_epi32(static_cast<int>(v[i]))));
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) _mm512_store_ps(O + (d0 + i) * 16, acc[i]);
}

}  // namespace

void prefill_attention_task_avx512bf16(const Task& a) {
  const int64_t T = a.T, L = a.L, D = a.D;
  const int64_t Tp = (T + 31) / 32 * 32;
  float* S = a.scratch;                                              // [Tp][16]
  uint16_t* P = reinterpret_cast<uint16_t*>(S + 16 * Tp);            // [Tp / 2][16][2]
  uint32_t* Vp = reinterpret_cast<uint32_t*>(P + 16 * Tp);           // [Tp / 2][D] key pairs
  float* O = reinterpret_cast<float*>(Vp + D * Tp / 2);              // [D][16]
  uint32_t* qp = reinterpret_cast<uint32_t*>(O + 16 * D);            // [D / 2][16]
  // V as key pairs once for the task's blocks, keys past T zero (0 x NaN would still be NaN): 16
  // dims of two keys a vector (a scalar loop here was most of a pass of a few queries a row).
  const uint16_t* v = static_cast<const uint16_t*>(a.v);
  for (int64_t tp = 0; tp < Tp / 2; ++tp) {
    const int64_t t = 2 * tp;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i lo = t < T ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(v + t * a.v_st + d)))
                               : _mm512_setzero_si512();
      const __m512i hi = t + 1 < T ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(v + (t + 1) * a.v_st + d)))
                                   : _mm512_setzero_si512();
      _mm512_storeu_si512(Vp + tp * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  const uint16_t* k = static_cast<const uint16_t*>(a.k);
  const uint16_t* q = static_cast<const uint16_t*>(a.q);
  uint16_t* out = static_cast<uint16_t*>(a.out);
  // The G heads' rows packed query-major (prefill_softmax::Block::packed): a block of one head's 16
  // queries left 12 of 16 lanes empty in a pass of 4 tokens a row (drafted decoding), and read the
  // keys and values once per head.
  const int64_t rows = a.G * L;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const prefill_softmax::Block blk = prefill_softmax::Block::packed(T, L, a.G, r0);
    const int64_t nq = blk.nq, n = blk.n;
    // Depth pair j of row r in lane r of vector j (lanes past nq zero).
    std::memset(qp, 0, size_t(D * 32));
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t h = (r0 + r) % a.G, i = (r0 + r) / a.G;
      uint32_t qr[64];
      std::memcpy(qr, q + h * a.q_sh + i * a.q_sl, size_t(D * 2));
      for (int64_t j = 0; j < D / 2; ++j) qp[j * 16 + r] = qr[j];
    }
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) score_keys<8>(qp, k + t * a.k_st, a.k_st, D, S + t * 16);
    for (; t < n; ++t) score_keys<1>(qp, k + t * a.k_st, a.k_st, D, S + t * 16);
    const __m512 tot = prefill_softmax::exponentials(blk, a.mask, S, P, a.scale);
    for (int64_t d0 = 0; d0 < D; d0 += 16) values16(P, Vp, D, blk.n32, d0, O);
    alignas(64) float total[16];
    _mm512_store_ps(total, tot);
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t h = (r0 + r) % a.G, i = (r0 + r) / a.G;
      prefill_softmax::write_row(O, total[r], r, D, out + h * a.o_sh + i * a.o_sl);
    }
  }
}

}  // namespace prefill_attention_common
}  // namespace ragfast
