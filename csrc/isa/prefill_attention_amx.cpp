// prefill_attention task kernel, ISA level "amx" (flags set for this file in CMake), for bf16 with
// head dims a multiple of 32 up to 128 (the dispatcher sends the rest to the portable task).
//
// A task is one (sequence, key/value head): its G heads x L queries run 16 at a time (16
// consecutive queries of one head), each block in three passes over the keys it can see:
//  1. scores as AMX-BF16 tile products, as in the decode kernel: 16 keys read in place from the
//     cache as the A tile times the block's queries as B tiles (VNNI: depth pairs x queries),
//     fp32 sums into a [16 keys x 16 queries] tile;
//  2. the softmax with the queries in the lanes (causal and padding masks as lane masks), whose
//     exponentials are written as bf16 pairs of keys: the B operand of the next product;
//  3. the values as tile products too, transposed: out^T [16 dims x 16 queries] += V^T [16 dims
//     x 32 keys] x P [32 keys x 16 queries], with V^T laid out once per task for all its blocks.
// The exponentials enter the values' product rounded to bf16 (as SDPA's bf16 kernels do); their
// sum, which divides it, stays fp32.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "../prefill_attention_common.h"
#include "amx_tiles.h"
#include "prefill_softmax.h"

namespace ragfast {
namespace prefill_attention_common {
namespace {

// Scores S[t][r] = q_r . k_t (unscaled) of 16 keys from `base` (rows `stride` bytes apart) into
// accumulator tile A with key tile K; the queries' depth chunks are in tmm2.. . A macro, as the
// tile intrinsics take their register numbers as literal text.
#define RAGFAST_SCORE_BLOCK(NAME, A, K)                                 \
  template <int NC>                                                    \
  inline void NAME(const char* base, int64_t stride, float* S) {       \
    _tile_zero(A);                                                     \
    _tile_loadd(K, base, stride);                                      \
    _tile_dpbf16ps(A, K, 2);                                           \
    if constexpr (NC > 1) {                                            \
      _tile_loadd(K, base + 64, stride);                               \
      _tile_dpbf16ps(A, K, 3);                                         \
    }                                                                  \
    if constexpr (NC > 2) {                                            \
      _tile_loadd(K, base + 128, stride);                              \
      _tile_dpbf16ps(A, K, 4);                                         \
    }                                                                  \
    if constexpr (NC > 3) {                                            \
      _tile_loadd(K, base + 192, stride);                              \
      _tile_dpbf16ps(A, K, 5);                                         \
    }                                                                  \
    _tile_stored(A, S, 64);                                            \
  }
RAGFAST_SCORE_BLOCK(score_block_even, 0, 1)
RAGFAST_SCORE_BLOCK(score_block_odd, 6, 7)
#undef RAGFAST_SCORE_BLOCK

// Scores of keys t < n, 16 a tile, two tiles a step in two accumulators (tmm0 / tmm6, key tiles
// tmm1 / tmm7), so that one block's store may overlap the other's products (measured alike to
// one accumulator on the Emerald Rapids VM, within its noise). Keys past T read as zeros from
// `tail`.
template <int NC>
void scores(const Task& a, const uint16_t* qt, uint16_t* tail, int64_t n, float* S) {
  const int64_t T = a.T, D = a.D, ks = a.k_st * 2;
  _tile_loadd(2, qt, 64);
  if constexpr (NC > 1) _tile_loadd(3, qt + 512, 64);
  if constexpr (NC > 2) _tile_loadd(4, qt + 1024, 64);
  if constexpr (NC > 3) _tile_loadd(5, qt + 1536, 64);
  auto rows = [&](int64_t t0, int64_t& stride) -> const char* {
    const char* base = static_cast<const char*>(a.k) + t0 * ks;
    stride = ks;
    if (T - t0 >= 16) return base;
    std::memset(tail, 0, size_t(16 * D * 2));  // a tile load reads 16 whole rows
    for (int64_t j = 0; j < T - t0; ++j) std::memcpy(tail + j * D, base + j * ks, size_t(D * 2));
    stride = D * 2;
    return reinterpret_cast<const char*>(tail);
  };
  for (int64_t t0 = 0; t0 < n; t0 += 32) {
    int64_t s0, s1;
    const char* b0 = rows(t0, s0);
    score_block_even<NC>(b0, s0, S + t0 * 16);
    if (t0 + 16 < n) {
      const char* b1 = rows(t0 + 16, s1);
      score_block_odd<NC>(b1, s1, S + (t0 + 16) * 16);
    }
  }
}

// out^T for dim chunks c0 .. c0 + NA - 1 (16 dims each) into O[d][16]: the accumulators tmm0..,
// the exponentials' pair rows tmm4, the transposed values tmm5 / tmm6 in turn.
template <int NA>
void values(const uint16_t* P, const uint16_t* Vt, int64_t Tp, int64_t n32, int64_t c0, float* O) {
  _tile_zero(0);
  if constexpr (NA > 1) _tile_zero(1);
  if constexpr (NA > 2) _tile_zero(2);
  if constexpr (NA > 3) _tile_zero(3);
  const int64_t vs = Tp * 2;
  for (int64_t t0 = 0; t0 < n32; t0 += 32) {
    _tile_loadd(4, P + t0 * 16, 64);
    const uint16_t* vt = Vt + c0 * 16 * Tp + t0;
    _tile_loadd(5, vt, vs);
    if constexpr (NA > 1) _tile_loadd(6, vt + 16 * Tp, vs);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (NA > 1) {
      if constexpr (NA > 2) _tile_loadd(5, vt + 32 * Tp, vs);
      _tile_dpbf16ps(1, 6, 4);
    }
    if constexpr (NA > 2) {
      if constexpr (NA > 3) _tile_loadd(6, vt + 48 * Tp, vs);
      _tile_dpbf16ps(2, 5, 4);
    }
    if constexpr (NA > 3) _tile_dpbf16ps(3, 6, 4);
  }
  _tile_stored(0, O + c0 * 256, 64);
  if constexpr (NA > 1) _tile_stored(1, O + (c0 + 1) * 256, 64);
  if constexpr (NA > 2) _tile_stored(2, O + (c0 + 2) * 256, 64);
  if constexpr (NA > 3) _tile_stored(3, O + (c0 + 3) * 256, 64);
}

}  // namespace

void prefill_attention_task_amx(const Task& a) {
  const int64_t T = a.T, L = a.L, D = a.D, nc = D / 32, nd = D / 16;
  const int64_t Tp = (T + 31) / 32 * 32;
  float* S = a.scratch;                                              // [Tp][16]
  uint16_t* P = reinterpret_cast<uint16_t*>(S + 16 * Tp);            // [Tp / 2][16][2]
  uint16_t* Vt = P + 16 * Tp;                                        // [D][Tp]
  float* O = reinterpret_cast<float*>(Vt + D * Tp);                  // [D][16]
  uint16_t* qt = reinterpret_cast<uint16_t*>(O + 16 * D);            // 4 x 512
  uint16_t* tail = qt + 2048;                                        // [16][D]
  // V^T once for the task's blocks, keys past T zero (a block's last pair rows of P are zero too,
  // but 0 x NaN would still be NaN in padding that held garbage).
  const uint16_t* v = static_cast<const uint16_t*>(a.v);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) Vt[d * Tp + t] = v[t * a.v_st + d];
  for (int64_t d = 0; d < D; ++d) std::memset(Vt + d * Tp + T, 0, size_t((Tp - T) * 2));
  amx_tiles::configure_16x64();
  for (int64_t h = 0; h < a.G; ++h) {
    for (int64_t i0 = 0; i0 < L; i0 += 16) {
      const prefill_softmax::Block blk(T, L, i0);
      const int64_t nq = blk.nq, n = blk.n, n32 = blk.n32;
      // B tiles: chunk c, row j (depth pair 32c + 2j, +1), query r: query r's 32-bit word 16c + j.
      std::memset(qt, 0, size_t(nc * 1024));
      uint32_t* qw = reinterpret_cast<uint32_t*>(qt);
      for (int64_t r = 0; r < nq; ++r) {
        uint32_t qr[64];
        std::memcpy(qr, static_cast<const uint16_t*>(a.q) + h * a.q_sh + (i0 + r) * a.q_sl, size_t(D * 2));
        for (int64_t j = 0; j < D / 2; ++j) qw[(j >> 4) * 256 + (j & 15) * 16 + r] = qr[j];
      }
      switch (nc) {
        case 1: scores<1>(a, qt, tail, n, S); break;
        case 2: scores<2>(a, qt, tail, n, S); break;
        case 3: scores<3>(a, qt, tail, n, S); break;
        default: scores<4>(a, qt, tail, n, S); break;
      }
      const __m512 tot = prefill_softmax::exponentials(blk, a.mask, S, P, a.scale);
      for (int64_t c = 0; c < nd; c += 4) {
        switch (nd - c < 4 ? nd - c : 4) {
          case 1: values<1>(P, Vt, Tp, n32, c, O); break;
          case 2: values<2>(P, Vt, Tp, n32, c, O); break;
          case 3: values<3>(P, Vt, Tp, n32, c, O); break;
          default: values<4>(P, Vt, Tp, n32, c, O); break;
        }
      }
      prefill_softmax::write_rows(O, tot, nq, D, static_cast<uint16_t*>(a.out) + h * a.o_sh + i0 * a.o_sl, a.o_sl);
    }
  }
  _tile_release();
}

}  // namespace prefill_attention_common
}  // namespace ragfast
