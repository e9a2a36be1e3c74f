// topk_ip kernels, ISA level "avx512": compiled with -mavx512f/bw/vl/dq/cd (Skylake-SP class, no
// BF16/VNNI): int8 widens to fp32; bf16 widens to fp32 in the stream kernels and runs the AVX2
// level's int16-quantised packed pass from 8 queries (TK_PAIRS2 in topk_ip_kernels.h).
// Target flags (csrc/isa_levels.h) are set for this file alone by CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU (csrc/isa.cpp).

#define TK_TABLE kernels_avx512
#define TK_NAME "avx512"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from, AMX from (amx level only)}. Measured as described in csrc/topk_ip.cpp (Paths). bf16,
// one thread, N=100k, forced avx512, ms stream / packed: d=384 B=4 9.4/9.4, B=8 12.4/11.6,
// B=16 19.0/15.1, B=256 218/125; d=768 B=4 18.9/18.9, B=8 25.1/22.7, B=256 398/249.
#define TK_DEFAULT_PATHS {{24, 1 << 30, 32, 1 << 30}, {1 << 30, 128, 8, 24}, {1 << 30, 1 << 30, 1 << 30, 1 << 30}}
#include "../topk_ip_kernels.h"
