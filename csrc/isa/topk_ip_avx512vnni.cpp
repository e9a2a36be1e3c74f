// topk_ip kernels, ISA level "avx512vnni": AVX-512 plus VNNI, without BF16 (Cascade Lake, Ice Lake,
// the common AVX-512 cloud CPUs): vpdpbusd int8 first passes; bf16 widens to fp32 in the stream
// kernels and is quantised per tile to int8 codes for vpdpbusd in the packed one.
// Target flags (csrc/isa_levels.h) are set for this file alone by CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU (csrc/isa.cpp).

#define TK_TABLE kernels_avx512vnni
#define TK_NAME "avx512vnni"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from}: those of avx512bf16, whose fp32 / fp16 / int8 code this level
// shares, and bf16 packed from 8 as there (no bf16 query-major form without BF16).
#define TK_DEFAULT_PATHS {{24, 1 << 30, 1 << 30, 1 << 30}, {1 << 30, 128, 8, 24}, {1 << 30, 1 << 30, 1 << 30, 1 << 30}}
#include "../topk_ip_kernels.h"
