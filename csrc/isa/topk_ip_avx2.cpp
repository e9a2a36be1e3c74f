// topk_ip kernels, ISA level "avx2": compiled with -mavx2 -mfma -mf16c (x86-64-v3 class: Haswell, Zen 1-3).
// Target flags are set for this file alone in CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU (csrc/isa.cpp).

#define TK_TABLE kernels_avx2
#define TK_NAME "avx2"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from}. Measured as described in csrc/topk_ip.cpp (Paths).
#define TK_DEFAULT_PATHS {{1 << 30, 1 << 30, 1 << 30, 1 << 30}, {16, 16, 16, 16}}
#include "../topk_ip_kernels.h"
