// topk_ip kernels, ISA level "amx": the avx512bf16 level plus AMX-TILE, AMX-BF16 and AMX-INT8
// (Sapphire, Emerald and Granite Rapids): tdpbf16ps tile scans for bf16 storage and for the
// bf16 first pass of fp32 storage, tdpbssd for int8 (scan_amx in csrc/topk_ip_kernels.h).
// Target flags are set for this file alone in CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU and the OS's permission to use the tiles (csrc/isa.cpp).

#define TK_TABLE kernels_amx
#define TK_NAME "amx"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from, AMX from}: below the AMX switch those of avx512bf16.
#define TK_DEFAULT_PATHS {{24, 1 << 30, 32, 1 << 30}, {1 << 30, 128, 8, 24}, {16, 1 << 30, 16, 16}}
#include "../topk_ip_kernels.h"
