// decode_attention task kernel, ISA level "amx" (flags set for this file in CMake), for bf16
// caches with head dims a multiple of 32 up to 128 and at most 16 query heads per key/value
// head (Qwen2.5's and Llama's; the dispatcher sends the rest to the avx512 task). The scores
// are AMX-BF16 tile products: 16 keys read in place from the cache as the A tile (32 depth
// values per 64-byte row) times the G queries laid out once per task as B tiles (VNNI: depth
// pairs by query head), fp32 sums into a [16 keys x 16 heads] tile. The softmax then runs with
// the heads in the lanes, and the values are weighted as at the avx512 level. On the AVX-512
// route the scores are, by instruction count, about two thirds of the task: per key, G dot
// products of D lanes and their horizontal sums; here they are two to four tile multiplies per
// 16 keys.
//
// Against the avx512 task the products and the sums' order differ (bf16 products are exact in
// fp32 either way; the scale multiplies the sum instead of the query), so results agree to
// fp32 rounding, not bit for bit.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "../decode_attention_common.h"
#include "amx_tiles.h"
#include "avx512_vec.h"
#include "decode_attention_values.h"

namespace ragfast {
namespace decode_attention_common {
namespace {

using namespace ragfast::avx512_vec;  // exp16

// Scores S[t][h] = q_h . k_t (unscaled) for t < T, 16 keys a tile; keys past T read as zeros.
// tmm0: the scores (16 keys x 16 fp32), tmm1: 16 keys x 32 bf16 of depth, tmm2..: the queries'
// depth chunks (16 depth pairs x 16 heads x 2 bf16).
template <int NC>
void scores(const Task& a, const uint16_t* qt, uint16_t* tail, float* S) {
  const int64_t T = a.T, D = a.D, ks = a.k_st * 2;
  amx_tiles::configure_16x64();
  _tile_loadd(2, qt, 64);
  if constexpr (NC > 1) _tile_loadd(3, qt + 512, 64);
  if constexpr (NC > 2) _tile_loadd(4, qt + 1024, 64);
  if constexpr (NC > 3) _tile_loadd(5, qt + 1536, 64);
  for (int64_t t0 = 0; t0 < T; t0 += 16) {
    const char* base = static_cast<const char*>(a.k) + t0 * ks;
    int64_t stride = ks;
    if (T - t0 < 16) {  // the last keys, zero padded: a tile load reads 16 whole rows
      std::memset(tail, 0, size_t(16 * D * 2));
      for (int64_t j = 0; j < T - t0; ++j) std::memcpy(tail + j * D, base + j * ks, size_t(D * 2));
      base = reinterpret_cast<const char*>(tail);
      stride = D * 2;
    }
    // Ask for the keys two tiles ahead: a tile load waits for its 16 rows' lines.
    if (t0 + 48 <= T)
      for (int j = 0; j < 16; ++j)
        for (int64_t c = 0; c < D * 2; c += 64) _mm_prefetch(base + (32 + j) * ks + c, _MM_HINT_T0);
    _tile_zero(0);
    _tile_loadd(1, base, stride);
    _tile_dpbf16ps(0, 1, 2);
    if constexpr (NC > 1) {
      _tile_loadd(1, base + 64, stride);
      _tile_dpbf16ps(0, 1, 3);
    }
    if constexpr (NC > 2) {
      _tile_loadd(1, base + 128, stride);
      _tile_dpbf16ps(0, 1, 4);
    }
    if constexpr (NC > 3) {
      _tile_loadd(1, base + 192, stride);
      _tile_dpbf16ps(0, 1, 5);
    }
    _tile_stored(0, S + t0 * 16, 64);
  }
  _tile_release();
}

}  // namespace

void decode_attention_task_amx(const Task& a) {
  const int64_t G = a.G, T = a.T, D = a.D, nc = D / 32, Tp = (T + 15) / 16 * 16;
  // scratch: scores [Tp][16] | sums for weigh_values_any [G][D] | query tiles nc x 1 KB | tail 16 x D bf16
  float* S = a.scratch;
  float* acc = S + 16 * Tp;
  uint16_t* qt = reinterpret_cast<uint16_t*>(acc + G * D);
  uint16_t* tail = qt + nc * 512;
  // B tiles: chunk c, row r (depth pair 32c + 2r, +1), head h: two bf16, that is query h's
  // 32-bit word 16c + r; heads past G are zeros. Copied a word at a time (a bf16 at a time with
  // the index arithmetic per value, this took a fifth of the task's scores and softmax).
  std::memset(qt, 0, size_t(nc * 1024));
  uint32_t* qw = reinterpret_cast<uint32_t*>(qt);
  for (int64_t h = 0; h < G; ++h) {
    uint32_t qh[64];  // D <= 128 at this level (pick_task)
    std::memcpy(qh, static_cast<const uint16_t*>(a.q) + h * a.q_sh, size_t(D * 2));
    for (int64_t j = 0; j < D / 2; ++j) qw[(j >> 4) * 256 + (j & 15) * 16 + h] = qh[j];
  }
  switch (nc) {
    case 1: scores<1>(a, qt, tail, S); break;
    case 2: scores<2>(a, qt, tail, S); break;
    case 3: scores<3>(a, qt, tail, S); break;
    default: scores<4>(a, qt, tail, S); break;
  }
  // Softmax with the heads in the lanes: scale, the visible keys' maximum, e^(s - max) and sums
  // (masked keys: 0). A head with no visible key keeps the maximum -inf and gets zeros.
  const __m512 scale = _mm512_set1_ps(a.scale);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < T; ++t) {
    if (a.mask && !a.mask[t]) continue;
    const __m512 r = _mm512_mul_ps(_mm512_load_ps(S + t * 16), scale);
    _mm512_store_ps(S + t * 16, r);
    mx = _mm512_max_ps(mx, r);
  }
  __m512 tot = _mm512_setzero_ps();
  for (int64_t t = 0; t < T; ++t) {
    __m512 e = _mm512_setzero_ps();
    prefetch_next(a.next_v, t, a.v_st * 2, D * 2);
    if (!a.mask || a.mask[t]) e = exp16(_mm512_sub_ps(_mm512_load_ps(S + t * 16), mx));
    _mm512_store_ps(S + t * 16, e);
    tot = _mm512_add_ps(tot, e);
  }
  alignas(64) float total[16];
  _mm512_store_ps(total, tot);
  switch (nc) {
    case 2: return weigh_values<4>(a, S, 1, 16, total);
    case 4: return weigh_values<8>(a, S, 1, 16, total);
    default: return weigh_values_any(a, S, 1, 16, total, acc, (D + 15) / 16, D);
  }
}

}  // namespace decode_attention_common
}  // namespace ragfast
