// The softmax and the output of a block of 16 queries with the queries in the lanes, shared by the
// prefill attention tasks that leave a block's scores as S[t][16] and take its exponentials as bf16
// key pairs (csrc/isa/prefill_attention_amx.cpp, prefill_attention_avx512bf16.cpp). It uses
// AVX512-BF16 (vcvtne2ps2bf16), so only files compiled with that level's flags or above may include
// it. In an anonymous namespace, as avx512_vec.h: each translation unit keeps its own copy.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "avx512_vec.h"

namespace ragfast {
namespace prefill_softmax {
namespace {

using namespace ragfast::avx512_vec;  // exp16, store16

// A block of up to 16 query rows of a task with T keys and L queries (the last L keys are the
// queries' own), one row per lane: its row count, the lowest key position a lane's query sits at
// (every key up to it is causally visible to the whole block), the keys any of its rows sees, that
// count rounded up to 32 (the exponentials' pair rows are written that far), and each lane's last
// visible key (lim). Two layouts: 16 queries i0.. of one head, or `packed`: rows r0.. of the G heads
// x L queries sharing one key/value head, query-major (row r is query r / G of head r % G), so a
// pass of few queries fills the lanes with the heads that read the same keys.
struct Block {
  int64_t nq, first, n, n32;
  alignas(64) int32_t lim[16];
  Block(int64_t T, int64_t L, int64_t i0)
      : nq(L - i0 < 16 ? L - i0 : 16), first(T - L + i0), n(first + nq), n32((n + 31) / 32 * 32) {
    for (int r = 0; r < 16; ++r) lim[r] = int32_t(first + r);
  }
  static Block packed(int64_t T, int64_t L, int64_t G, int64_t r0) {
    Block b(T, L, 0);
    b.nq = G * L - r0 < 16 ? G * L - r0 : 16;
    for (int r = 0; r < 16; ++r) b.lim[r] = int32_t(T - L + (r0 + (r < b.nq ? r : b.nq - 1)) / G);
    b.first = b.lim[0];
    b.n = int64_t(b.lim[b.nq - 1]) + 1;
    b.n32 = (b.n + 31) / 32 * 32;
    return b;
  }
  // The lanes that see key t: t <= lim[r], where its padding byte allows.
  __mmask16 lanes(const uint8_t* mask, int64_t t) const {
    if (mask && !mask[t]) return 0;
    if (t <= first) return __mmask16(0xffff);
    return _mm512_cmpge_epi32_mask(_mm512_load_si512(lim), _mm512_set1_epi32(int32_t(t)));
  }
};

// Scales the block's scores S[t][16] (keys t < b.n) in place and writes the exponentials of
// (score - the lane's maximum over its visible keys) as bf16 pairs of keys, P[t / 2][16][2] for
// t < b.n32 (zero past b.n and outside a key's lanes). Returns the lanes' sums of the
// exponentials (fp32, before rounding).
inline __m512 exponentials(const Block& b, const uint8_t* mask, float* S, uint16_t* P, float scale) {
  const int64_t n = b.n, n32 = b.n32;
  auto lanes = [&](int64_t t) { return b.lanes(mask, t); };
  // The exponentials' pair rows: key t's and t + 1's value for query r side by side.
  alignas(64) static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pidx = _mm512_load_si512(pair_idx);
  const __m512 sv = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 r = _mm512_mul_ps(_mm512_load_ps(S + t * 16), sv);
    _mm512_store_ps(S + t * 16, r);
    mx = _mm512_mask_max_ps(mx, lanes(t), mx, r);
  }
  __m512 tot = _mm512_setzero_ps();
  for (int64_t t = 0; t < n32; t += 2) {
    __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
    if (t < n) e0 = _mm512_maskz_mov_ps(lanes(t), exp16(_mm512_sub_ps(_mm512_load_ps(S + t * 16), mx)));
    if (t + 1 < n) e1 = _mm512_maskz_mov_ps(lanes(t + 1), exp16(_mm512_sub_ps(_mm512_load_ps(S + (t + 1) * 16), mx)));
    tot = _mm512_add_ps(tot, _mm512_add_ps(e0, e1));
    const __m512i pair = _mm512_permutexvar_epi16(pidx, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    _mm512_store_si512(P + t * 16, pair);
  }
  return tot;
}

// Row r of a block's output (bf16, at row) = O[d][r] / tot[r] for its D dims (O holds [D][16] fp32
// sums); a row with no visible key gets zeros.
inline void write_row(const float* O, float total, int64_t r, int64_t D, uint16_t* row) {
  const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(16));
  const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.f / total : 0.f);
  for (int64_t c = 0; c < D / 16; ++c)  // dims 16c.. of row r: a column of O
    store16(row, 16 * c, _mm512_mul_ps(_mm512_i32gather_ps(col, O + c * 256 + r, 4), inv), 0xffff, true);
}

// The block's outputs for queries i0.. of one head: query r's row at out + r * o_sl.
inline void write_rows(const float* O, __m512 tot, int64_t nq, int64_t D, uint16_t* out, int64_t o_sl) {
  alignas(64) float total[16];
  _mm512_store_ps(total, tot);
  for (int64_t r = 0; r < nq; ++r) write_row(O, total[r], r, D, out + r * o_sl);
}

}  // namespace
}  // namespace prefill_softmax
}  // namespace ragfast
