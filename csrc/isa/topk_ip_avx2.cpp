// topk_ip kernels, ISA level "avx2": compiled with -mavx2 -mfma -mf16c (x86-64-v3 class: Haswell, Zen 1-3).
// Target flags are set for this file alone in CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU (csrc/isa.cpp).

#define TK_TABLE kernels_avx2
#define TK_NAME "avx2"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from}. Measured as described in csrc/topk_ip.cpp (Paths).
// The packed family loses to stream at every batch on AVX2 (only 16 registers; measured
// round-robin, N=100k/50k, d=384, Zen 4 forced to avx2: packed/stream 1.4x slower at B=16,
// 1.4x at B=64, 1.5x at B=256), so stream throughout; torch takes over where it is faster
// (python/ragfast/ops/topk_ip_choice.py).
#define TK_DEFAULT_PATHS {{1 << 30, 1 << 30, 1 << 30, 1 << 30}, {1 << 30, 1 << 30, 1 << 30, 1 << 30}}
#include "../topk_ip_kernels.h"
