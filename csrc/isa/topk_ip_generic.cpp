// topk_ip kernels, ISA level "generic": portable C++ only (compiler-vectorised for the baseline target: SSE2 on x86-64, NEON on aarch64).
// Target flags (csrc/isa_levels.h) are set for this file alone by CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU (csrc/isa.cpp).
#define TK_GENERIC 1
#define TK_TABLE kernels_generic
#define TK_NAME "generic"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from, AMX from (amx level only)}. Measured as described in csrc/topk_ip.cpp (Paths).
#define TK_DEFAULT_PATHS {{1 << 30, 1 << 30, 1 << 30, 1 << 30}, {1 << 30, 1 << 30, 1 << 30, 1 << 30}, {1 << 30, 1 << 30, 1 << 30, 1 << 30}}
#include "../topk_ip_kernels.h"
