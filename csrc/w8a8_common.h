// Shared by csrc/w8a8.cpp (dispatcher) and its per-ISA row kernels (csrc/isa/w8a8_<level>.cpp).
// Plain declarations only: see csrc/topk_ip_common.h for why nothing inline is shared.
#pragma once
#include <cstdint>

#include "isa_compiled.h"

namespace ragfast {
namespace w8a8_common {

// One row of K values (fp32, or bf16 when `bf16`) to int8 codes and its scale (csrc/w8a8.cpp).
using QuantizeRowFn = void (*)(const void* x, bool bf16, int64_t K, int8_t* codes, float* scale);
// One row of N int32 sums to floats: float(acc) * s * ws[n] (+ bias[n]), fp32 or bf16 out.
using DequantizeRowFn = void (*)(const int32_t* acc, int64_t N, float s, const float* ws, const float* bias, void* y,
                                 bool bf16);

#ifdef RAGFAST_ISA_HAVE_avx512
void w8a8_quantize_row_avx512(const void* x, bool bf16, int64_t K, int8_t* codes, float* scale);
void w8a8_dequantize_row_avx512(const int32_t* acc, int64_t N, float s, const float* ws, const float* bias, void* y,
                                bool bf16);
// One row of 2 x `half` int32 sums, a gate's then an up projection's (ws likewise), to
// silu(gate) * up: each dequantised as above (no bias), then silu_mul's row; `half` values out.
void w8a8_silu_mul_row_avx512(const int32_t* acc, int64_t half, float s, const float* ws, void* y, bool bf16);
#endif
#ifdef RAGFAST_ISA_HAVE_avx512vnni
// w8a8_matmul_cols_amx's product with AVX-512 VNNI on the same packed codes and with the same
// epilogue (the same bits); xq's M rows are K bytes apart, no tail copy needed
// (csrc/isa/w8a8_avx512vnni.cpp).
void w8a8_matmul_cols_avx512vnni(const int8_t* xq, int64_t M, int64_t K, const float* xs, const int8_t* packed,
                                 int64_t N, int64_t j0, int64_t j1, const float* ws, const float* bias, void* y,
                                 int64_t ldy, bool bf16, bool silu);
#endif
#ifdef RAGFAST_ISA_HAVE_amx
// y[m, n] for n in column groups [j0, j1) (16 columns each) of the packed weight: AMX-INT8 sums
// of xq[M, K] (rows K apart; the last M % 16 rows also as the zero-padded 16 x K `tail`) turned
// into floats as w8a8_dequantize_row_avx512 does, or with `silu` (j0, j1 multiples of 8, N of
// 128) a gate and up projection interleaved by 64 columns into silu(gate) * up as
// w8a8_silu_mul_row_avx512 does (csrc/isa/w8a8_amx.cpp has the layouts).
void w8a8_matmul_cols_amx(const int8_t* xq, const int8_t* tail, int64_t M, int64_t K, const float* xs,
                          const int8_t* packed, int64_t N, int64_t j0, int64_t j1, const float* ws, const float* bias,
                          void* y, int64_t ldy, bool bf16, bool silu);
#endif

}  // namespace w8a8_common
}  // namespace ragfast
