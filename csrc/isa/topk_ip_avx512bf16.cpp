// topk_ip kernels, ISA level "avx512bf16": AVX-512 plus BF16 and VNNI (Zen 4, Sapphire Rapids): vdpbf16ps / vpdpbusd first passes.
// Target flags are set for this file alone in CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU (csrc/isa.cpp).

#define TK_TABLE kernels_avx512bf16
#define TK_NAME "avx512bf16"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from}. Measured as described in csrc/topk_ip.cpp (Paths). bf16
// packs its tiles as int8 codes for vpdpbusd (pack_tile_bf16q); one thread, N=100k, ms
// stream / query-major / packed: d=384 B=16 17.3/21.7/14.3, B=64 39.6/30.9/23.8, B=256
// 124/108/64; d=768 B=32 43.6/33.9/47.4, B=64 65.4/55.5/60.1, B=256 222/207/139 (at d=768 the
// quantised tile outgrows L1 and its packing costs ~0.4 us a row, hence the shared switch at 64).
#define TK_DEFAULT_PATHS {{24, 1 << 30, 32, 1 << 30}, {1 << 30, 128, 64, 24}}
#include "../topk_ip_kernels.h"
