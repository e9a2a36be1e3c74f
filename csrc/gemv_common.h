// Shared by csrc/gemv.cpp (dispatcher) and its per-ISA kernels (csrc/isa/gemv_<level>.cpp).
// Plain declarations only: see csrc/topk_ip_common.h for why nothing inline is shared.
#pragma once
#include <cstdint>

#include "isa_compiled.h"

namespace ragfast {
namespace gemv_common {

// Weight storage of a gemv call: the model's fp32 or bf16 matrix, or int8 codes (one scale per
// output row, applied by the dispatcher after the dot products).
enum WeightKind : int { kF32 = 0, kBF16 = 1, kI8 = 2 };

// Raw dot products of a block of output rows: y[m * ldy + n] = sum_k x[m * K + k] * w[n, k] for
// m < M and n0 <= n < n1, where w's row n starts at (element) n * ldw. x is fp32, contiguous.
// Sums are in fp32; the order of the additions is the level's own.
using BlockFn = void (*)(const float* x, int64_t M, int64_t K, const void* w, int kind, int64_t ldw, int64_t n0,
                         int64_t n1, float* y, int64_t ldy);

// The same for bf16 x and bf16 weights, x as bf16 (levels with a bf16 dot product).
using Bf16BlockFn = void (*)(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t ldw, int64_t n0,
                             int64_t n1, float* y, int64_t ldy);

// int8 weights times bf16 x at levels with VNNI (csrc/isa/gemv_avx512vnni.cpp): each row of x as
// a 23-bit fixed point, q = round(x / scale[m]) = hi * 65536 + mid * 256 + lo, its parts signed
// bytes, padded with zeros from K to Kp (K rounded up to 64), and per row and part the 16 lanes'
// sums of 128 * part that vpdpbusd's unsigned operand adds. The caller owns the buffers.
struct I8Parts {
  static constexpr int32_t kQMax = 127 * 65536 + 127 * 256 + 127;  // the largest |q| whose parts fit
  int64_t M, K, Kp;
  int8_t* parts;   // [M][3][Kp]: hi, mid, lo
  int32_t* corr;   // [M][3][16]
  float* scale;    // [M]: max|x row| / kQMax
};

// csrc/isa/gemv_<level>.cpp, compiled with the level (isa_compiled.h says which are)
#ifdef RAGFAST_ISA_HAVE_avx2
void gemv_block_avx2(const float* x, int64_t M, int64_t K, const void* w, int kind, int64_t ldw, int64_t n0,
                     int64_t n1, float* y, int64_t ldy);
#endif
#ifdef RAGFAST_ISA_HAVE_avx512
void gemv_block_avx512(const float* x, int64_t M, int64_t K, const void* w, int kind, int64_t ldw, int64_t n0,
                       int64_t n1, float* y, int64_t ldy);
#endif
#ifdef RAGFAST_ISA_HAVE_avx512vnni
// Fills xp's parts, sums and scales from bf16 x (rows ldx apart); false if x holds NaN or infinity.
bool gemv_i8_prepare_avx512vnni(const uint16_t* x, int64_t ldx, I8Parts& xp);
// Raw dot products (as BlockFn's) of int8 weight rows n0..n1 with the prepared rows of x.
void gemv_block_i8_avx512vnni(const I8Parts& xp, const int8_t* w, int64_t ldw, int64_t n0, int64_t n1, float* y,
                              int64_t ldy);
// The same sums, times x's row scales, for int8 codes in w8a8's packed layout (column groups of 16
// output rows, each K / 4 rows of 64 bytes whose lane n holds row n's depth quad: see
// python/ragfast/ops/w8a8.py, pack_codes; K a multiple of 64), column groups g0..g1:
// y[m * ldy + 16 g + c] for c < 16 (padding rows give 0).
void gemv_block_i8_packed_avx512vnni(const I8Parts& xp, const int8_t* packed, int64_t g0, int64_t g1, float* y,
                                     int64_t ldy);
#endif
#ifdef RAGFAST_ISA_HAVE_avx512bf16
void gemv_block_bf16_avx512bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t ldw, int64_t n0,
                                int64_t n1, float* y, int64_t ldy);
#endif

}  // namespace gemv_common
}  // namespace ragfast
