// w8a8 matmul, ISA level "avx512vnni" (flags set for this file in CMake; avx512bf16 runs it too,
// amx has its tiles): int8 activations times int8 weights with AVX-512 VNNI (vpdpbusd), on the
// very codes w8a8_matmul_cols_amx reads (python/ragfast/ops/w8a8.py, pack_codes), each
// row block x strip of sums turned into floats in cache by the avx512 level's dequantising row:
// the same bits as torch._int_mm followed by w8a8_dequantize (int32 sums are exact).
//
// Why a kernel when torch._int_mm runs oneDNN's VNNI code: _int_mm is handed the row-major codes
// and re-blocks them on every call, then writes [M, N] int32 sums that a second pass scales; here
// the codes are blocked once and each strip of sums is scaled while still in L1.
//
// vpdpbusd multiplies unsigned bytes by signed bytes. The weight's codes go in as the unsigned
// operand with their sign bit flipped (w + 128), the activations' quads broadcast as the signed
// one, so each sum comes out as sum(w x) + 128 sum(x): the row's code sum times 128 is taken off
// (exact in int32: |sum| <= 255 * 127 * K, under 2^31 for any K below 66,000).
//
// Layout of a column group j (16 output columns): K / 4 rows of 64 bytes, row r the 16 columns'
// depth quads 4r..4r+3 = one zmm, lane n holding column n's quad. Blocking: kRows rows x up to 4
// column groups = 24 zmm accumulators, 4 zmm of weights per depth quad, each reused by the 6
// rows' broadcasts. A thread walks strips of 8 column groups (128 columns: with silu a gate's 64
// columns and the up projection's 64) and, within one, every row block; a strip's weights (128 x K
// bytes) stay in L2 between row blocks, so each weight byte comes from memory once per call.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../w8a8_common.h"

namespace ragfast {
namespace w8a8_common {
namespace {

constexpr int kRows = 6;                       // rows per register block
constexpr int64_t kStrip = 8, kLdc = kStrip * 16;  // column groups per strip; int32 row stride of its sums

// acc += u (unsigned bytes) . s (signed bytes), by quads. As inline assembly because GCC's
// _mm512_dpbusd_epi32 left the 24 accumulators copied between registers and the stack on every
// depth step (a third of the peak multiply-add rate at 64 rows); "+v" keeps each in its register.
inline void dpbusd(__m512i& acc, __m512i u, __m512i s) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s)); }

// Sums of R rows (x rows K bytes apart, their code sums in rsum) by NQ column groups of 16 (the
// groups' packed streams gbytes apart from b), into C (rows kLdc int32 apart).
template <int R, int NQ>
void block(const int8_t* x, int64_t K, const int32_t* rsum, const int8_t* b, int64_t gbytes, int32_t* C) {
  // The loops over rows and groups are unrolled whole so that every accumulator is a register.
  __m512i acc[R][NQ];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int q = 0; q < NQ; ++q) acc[i][q] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t r = 0; r < K / 4; ++r) {
    __m512i w[NQ];
#pragma GCC unroll 4
    for (int q = 0; q < NQ; ++q) w[q] = _mm512_xor_si512(_mm512_loadu_si512(b + q * gbytes + r * 64), flip);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      int32_t quad;
      std::memcpy(&quad, x + i * K + 4 * r, 4);
      const __m512i a = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
      for (int q = 0; q < NQ; ++q) dpbusd(acc[i][q], w[q], a);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const __m512i off = _mm512_set1_epi32(rsum[i] * 128);
#pragma GCC unroll 4
    for (int q = 0; q < NQ; ++q) _mm512_storeu_si512(C + i * kLdc + q * 16, _mm512_sub_epi32(acc[i][q], off));
  }
}

using BlockFn = void (*)(const int8_t*, int64_t, const int32_t*, const int8_t*, int64_t, int32_t*);

template <int R>
constexpr BlockFn pick(int nq) {
  return nq == 1 ? &block<R, 1> : nq == 2 ? &block<R, 2> : nq == 3 ? &block<R, 3> : &block<R, 4>;
}

BlockFn block_fn(int rows, int nq) {
  switch (rows) {
    case 1: return pick<1>(nq);
    case 2: return pick<2>(nq);
    case 3: return pick<3>(nq);
    case 4: return pick<4>(nq);
    case 5: return pick<5>(nq);
    default: return pick<6>(nq);
  }
}

// The sum of one row's K codes (vpdpbusd of all-ones bytes by the codes: 64 per instruction).
int32_t code_sum(const int8_t* x, int64_t K) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i s = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(x + k));
  return _mm512_reduce_add_epi32(s);
}

}  // namespace

void w8a8_matmul_cols_avx512vnni(const int8_t* xq, int64_t M, int64_t K, const float* xs, const int8_t* packed,
                                 int64_t N, int64_t j0, int64_t j1, const float* ws, const float* bias, void* y,
                                 int64_t ldy, bool bf16, bool silu) {
  std::vector<int32_t> rsum(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) rsum[m] = code_sum(xq + m * K, K);
  alignas(64) int32_t C[kRows * kLdc];
  const int64_t gbytes = K * 16;  // one column group's packed bytes
  const size_t width = bf16 ? 2 : 4;
  for (int64_t s0 = j0; s0 < j1; s0 += kStrip) {
    const int64_t s1 = std::min(j1, s0 + kStrip);
    const int64_t n0 = s0 * 16, ncols = std::min(N, s1 * 16) - n0;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      for (int64_t j = s0; j < s1; j += 4) {
        const int nq = static_cast<int>(std::min<int64_t>(4, s1 - j));
        block_fn(rows, nq)(xq + m0 * K, K, rsum.data() + m0, packed + j * gbytes, gbytes, C + (j - s0) * 16);
      }
      for (int i = 0; i < rows; ++i) {
        const int64_t m = m0 + i;
        char* out = static_cast<char*>(y) + size_t(m * ldy + (silu ? n0 / 2 : n0)) * width;
        if (silu)  // a whole strip: 64 gate then 64 up columns, into output columns n0 / 2 on
          w8a8_silu_mul_row_avx512(C + i * kLdc, kLdc / 2, xs[m], ws + n0, out, bf16);
        else
          w8a8_dequantize_row_avx512(C + i * kLdc, ncols, xs[m], ws + n0, bias ? bias + n0 : nullptr, out, bf16);
      }
    }
  }
}

}  // namespace w8a8_common
}  // namespace ragfast
