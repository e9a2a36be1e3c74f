// topk_ip kernels, ISA level "avx512": compiled with -mavx512f/bw/vl/dq/cd (Skylake-SP class, no BF16/VNNI: int8 and bf16 widen to fp32).
// Target flags are set for this file alone in CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU (csrc/isa.cpp).

#define TK_TABLE kernels_avx512
#define TK_NAME "avx512"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from}. Measured as described in csrc/topk_ip.cpp (Paths).
#define TK_DEFAULT_PATHS {{24, 1 << 30, 32, 1 << 30}, {1 << 30, 128, 1 << 30, 24}}
#include "../topk_ip_kernels.h"
