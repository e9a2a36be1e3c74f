// topk_ip kernels, ISA level "avx2": compiled with -mavx2 -mfma -mf16c (x86-64-v3 class: Haswell, Zen 1-3).
// Target flags (csrc/isa_levels.h) are set for this file alone by CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU (csrc/isa.cpp).

#define TK_TABLE kernels_avx2
#define TK_NAME "avx2"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from, AMX from (amx level only)}. Measured as described in csrc/topk_ip.cpp (Paths).
// Stream (one row at a time for the first query pair of a tile, then 4 rows x 2 queries)
// below the packed kernels: the 6 x 16 GEMM-style one for fp32/fp16 from 16 queries, its int8
// form (vpmaddwd on int16 depth pairs) from 24, and for bf16 the same int16 kernel over tiles
// quantised per row, from 6. Measured round-robin, N=100k, one thread, Zen 4 forced to avx2,
// packed time / stream time: fp32 d=384: B=12 1.07, 24 0.90, 64 0.76, 256 0.73; d=768: B=12
// 1.00, 24 0.85, 64 0.74, 256 0.67. int8 d=384: B=8 1.33, 16 1.07, 64 0.76, 256 0.66; d=768:
// B=16 0.97, 64 0.77, 256 0.75. bf16 d=384: B=4 1.08, 6 0.91, 8 0.83, 16 0.65; d=768: B=4
// 1.10, 6 0.99, 8 0.92, 16 0.72. torch takes over where it is faster
// (python/ragfast/ops/topk_ip_choice.py).
#define TK_DEFAULT_PATHS {{1 << 30, 1 << 30, 1 << 30, 1 << 30}, {16, 16, 6, 24}, {1 << 30, 1 << 30, 1 << 30, 1 << 30}}
#include "../topk_ip_kernels.h"
