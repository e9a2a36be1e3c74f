// w8a8 matmul, ISA level "amx" (flags set for this file in CMake): int8 activations times int8
// weights with AMX-INT8 tile multiplies (tdpbssd: exact int32 sums, signed by signed), each
// 32-row x 128-column strip of sums turned into floats while still in cache by the avx512
// level's dequantising row (the same bits as torch._int_mm followed by w8a8_dequantize).
//
// Layouts (python/ragfast/ops/w8a8.py packs the weight once, the dispatcher in csrc/w8a8.cpp
// splits the columns between threads):
//  * activations: int8 codes [M, K], rows K bytes apart, K a multiple of 64; the last partial
//    16-row group (M % 16 rows) comes from `tail`, a zero-padded 16 x K copy, so no tile load
//    reads past the rows;
//  * weights: column group j (16 output columns, zero past N) holds K / 4 rows of 64 bytes,
//    row r = the 16 columns' depth quads 4r..4r+3 (the VNNI layout tdpbssd's B operand takes):
//    the tile of group j and depth chunk c is the 1 KB at packed + (j * K / 4 + 16 c) * 64.
// With `silu` the weight is a gate and an up projection interleaved by 64 output columns
// (python/ragfast/ops/w8a8.py, pack_gate_up): each strip's sums are 64 gate and 64 up columns,
// and the strip's epilogue writes silu(gate) * up, 64 output columns (csrc/isa/w8a8_avx512.cpp).
// Blocking: 2 row groups x 2 column groups = 4 accumulator tiles (tmm0-3), 2 A tiles (tmm4-5),
// 2 B tiles (tmm6-7): 4 tile multiplies per 4 tile loads, the loads of the next depth chunk
// interleaved with this chunk's multiplies. The A rows (all M x K of them) stay in
// L2 while a thread walks its columns; each weight byte is read from memory once per call.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "../w8a8_common.h"
#include "amx_tiles.h"

namespace ragfast {
namespace w8a8_common {
namespace {

// Bytes ahead in a column group's packed stream that the first row pair prefetches (1-8 KB and
// none measured alike within this VM's noise; kept for machines whose prefetchers miss tile loads).
constexpr int64_t kPrefetch = 4096;
// Column groups (16 columns each) per strip, and the int32 row stride of a strip's sums.
constexpr int64_t kStrip = 8, kLdc = kStrip * 16;

// Sums of row groups g0 (and g0 + 1 when NG = 2) by column groups j0 (and j0 + 1 when NQ = 2),
// stored into C (rows kLdc int32 apart). Software pipelined: a tile register is reloaded with the
// next depth chunk right after the last multiply of this chunk that reads it, so the loads
// overlap the multiplies still running (the registers are not renamed: all four loads first,
// then four multiplies, left each load waiting on the previous chunk's multiplies; 1.10-1.28x
// at 64 rows of the 0.5B's layers).
template <int NG, int NQ, typename Step>
void block(const int8_t* a0, const int8_t* a1, int64_t K, const int8_t* b0, const int8_t* b1, int32_t* C, bool pf,
           Step& step) {
  _tile_zero(0);
  if constexpr (NQ > 1) _tile_zero(1);
  if constexpr (NG > 1) {
    _tile_zero(2);
    if constexpr (NQ > 1) _tile_zero(3);
  }
  _tile_loadd(4, a0, K);
  _tile_loadd(6, b0, 64);  // chunk c = k / 64 starts 16 c rows of 64 bytes in
  if constexpr (NQ > 1) _tile_loadd(7, b1, 64);
  if constexpr (NG > 1) _tile_loadd(5, a1, K);
  for (int64_t k = 0; k < K; k += 64) {
    const bool more = k + 64 < K;
    const int64_t kn = k + 64;
    if (pf) {
      // The weights come from memory once (the first row pair): a tile load waits for its 16
      // lines, so ask for them kPrefetch bytes ahead in both column groups' streams.
      for (int i = 0; i < 1024; i += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(b0 + k * 16 + kPrefetch + i), _MM_HINT_T0);
        if constexpr (NQ > 1) _mm_prefetch(reinterpret_cast<const char*>(b1 + k * 16 + kPrefetch + i), _MM_HINT_T0);
      }
    }
    _tile_dpbssd(0, 4, 6);
    if constexpr (NQ > 1) _tile_dpbssd(1, 4, 7);
    if (more) _tile_loadd(4, a0 + kn, K);  // tmm4's last reader was issued
    if constexpr (NG > 1) {
      _tile_dpbssd(2, 5, 6);
      if (more) _tile_loadd(6, b0 + kn * 16, 64);
      if constexpr (NQ > 1) {
        _tile_dpbssd(3, 5, 7);
        if (more) _tile_loadd(7, b1 + kn * 16, 64);
      }
      if (more) _tile_loadd(5, a1 + kn, K);
    } else if (more) {
      _tile_loadd(6, b0 + kn * 16, 64);
      if constexpr (NQ > 1) _tile_loadd(7, b1 + kn * 16, 64);
    }
    step();  // vector work the core runs while the tile unit multiplies
  }
  _tile_stored(0, C, kLdc * 4);
  if constexpr (NQ > 1) _tile_stored(1, C + 16, kLdc * 4);
  if constexpr (NG > 1) {
    _tile_stored(2, C + 16 * kLdc, kLdc * 4);
    if constexpr (NQ > 1) _tile_stored(3, C + 16 * kLdc + 16, kLdc * 4);
  }
}

// The epilogue of one 32-row x strip block of sums: rows m0..m1 of C (row m at C + (m - m0) *
// kLdc) into y, dequantised (or silu(gate) * up), one row per call of next().
struct Epilogue {
  const int32_t* C = nullptr;
  int64_t m0 = 0, m = 0, m1 = 0, n0 = 0, ncols = 0;
  const float *xs, *ws, *bias;
  void* y;
  int64_t ldy;
  bool bf16, silu;
  void next() {
    if (m >= m1) return;
    const int32_t* row = C + (m - m0) * kLdc;
    const size_t width = bf16 ? 2 : 4;
    if (silu)  // a whole strip: 64 gate then 64 up columns, into output columns n0 / 2 on
      w8a8_silu_mul_row_avx512(row, kLdc / 2, xs[m], ws + n0, static_cast<char*>(y) + size_t(m * ldy + n0 / 2) * width,
                               bf16);
    else
      w8a8_dequantize_row_avx512(row, ncols, xs[m], ws + n0, bias ? bias + n0 : nullptr,
                                 static_cast<char*>(y) + size_t(m * ldy + n0) * width, bf16);
    ++m;
  }
  void finish() {
    while (m < m1) next();
  }
};

}  // namespace

void w8a8_matmul_cols_amx(const int8_t* xq, const int8_t* tail, int64_t M, int64_t K, const float* xs,
                          const int8_t* packed, int64_t N, int64_t j0, int64_t j1, const float* ws, const float* bias,
                          void* y, int64_t ldy, bool bf16, bool silu) {
  amx_tiles::configure_16x64();
  // Sums of 32 rows x a strip of up to kStrip column groups, then dequantised row by row: one
  // call and whole cache lines of y per row and strip, rather than per 32 x 32 block (the lm
  // head's 151,936 columns made that 300,000 calls of two vectors each). Two buffers of sums:
  // while the tiles fill one, the previous block's rows are dequantised from the other, a row
  // per depth step of the tile loop, so the vector units work while the tile unit multiplies
  // (one after the other, the epilogue took about a quarter of a gate/up product's time).
  alignas(64) int32_t C[2][32 * kStrip * 16];
  Epilogue ep{};
  ep.xs = xs;
  ep.ws = ws;
  ep.bias = bias;
  ep.y = y;
  ep.ldy = ldy;
  ep.bf16 = bf16;
  ep.silu = silu;
  auto step = [&ep] { ep.next(); };
  int buf = 0;
  const int64_t groups = (M + 15) / 16, full = M / 16;
  const int64_t gbytes = K * 16;  // one column group's packed bytes
  auto rows_of = [&](int64_t g) { return g < full ? xq + g * 16 * K : tail; };
  for (int64_t s0 = j0; s0 < j1; s0 += kStrip) {
    const int64_t s1 = std::min(j1, s0 + kStrip);
    const int64_t n0 = s0 * 16, ncols = std::min(N, s1 * 16) - n0;
    for (int64_t g = 0; g < groups; g += 2) {
      const bool two_g = g + 1 < groups;
      const int8_t* a0 = rows_of(g);
      const int8_t* a1 = two_g ? rows_of(g + 1) : nullptr;
      int32_t* Cb = C[buf];
      for (int64_t j = s0; j < s1; j += 2) {
        const bool two_q = j + 1 < s1;
        const int8_t* b0 = packed + j * gbytes;
        const int8_t* b1 = b0 + gbytes;
        int32_t* Cj = Cb + (j - s0) * 16;
        if (two_g && two_q) block<2, 2>(a0, a1, K, b0, b1, Cj, g == 0, step);
        else if (two_g) block<2, 1>(a0, a1, K, b0, b1, Cj, g == 0, step);
        else if (two_q) block<1, 2>(a0, a1, K, b0, b1, Cj, g == 0, step);
        else block<1, 1>(a0, a1, K, b0, b1, Cj, g == 0, step);
      }
      ep.finish();  // the previous block's rows (usually done within the tile loops above)
      ep.C = Cb;
      ep.m0 = ep.m = g * 16;
      ep.m1 = std::min<int64_t>(M, g * 16 + (two_g ? 32 : 16));
      ep.n0 = n0;
      ep.ncols = ncols;
      buf ^= 1;
    }
  }
  ep.finish();
  _tile_release();
}

}  // namespace w8a8_common
}  // namespace ragfast
