// topk_ip kernels, ISA level "avx512bf16": AVX-512 plus BF16 and VNNI (Zen 4, Sapphire Rapids): vdpbf16ps / vpdpbusd first passes.
// Target flags (csrc/isa_levels.h) are set for this file alone by CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU (csrc/isa.cpp).

#define TK_TABLE kernels_avx512bf16
#define TK_NAME "avx512bf16"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from, AMX from (amx level only)}. Measured as described in csrc/topk_ip.cpp (Paths). bf16
// packs its tiles as int8 codes for vpdpbusd (pack_tile_bf16q); one thread, N=100k, ms
// stream / query-major / packed: d=384 B=4 7.5/18.8/9.5, B=8 11.2/19.2/10.2, B=32
// 23.0/19.6/14.9, B=256 130/110/62; d=768 B=4 13.9/35.8/18.0, B=8 22.0/36.3/19.9, B=32
// 40.3/33.6/29.2, B=256 224/208/115.
#define TK_DEFAULT_PATHS {{24, 1 << 30, 32, 1 << 30}, {1 << 30, 128, 8, 24}, {1 << 30, 1 << 30, 1 << 30, 1 << 30}}
#include "../topk_ip_kernels.h"
