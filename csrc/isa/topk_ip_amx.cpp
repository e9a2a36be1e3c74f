// topk_ip kernels, ISA level "amx": the avx512bf16 level plus AMX-TILE, AMX-BF16 and AMX-INT8
// (Sapphire, Emerald and Granite Rapids): tdpbf16ps tile scans for bf16 storage and for the
// bf16 first pass of fp32 and fp16 storage, tdpbssd for int8 (scan_amx in csrc/topk_ip/amx.h).
// Target flags (csrc/isa_levels.h) are set for this file alone by CMakeLists.txt; the dispatcher only calls into
// it after checking the running CPU and the OS's permission to use the tiles (csrc/isa.cpp).

#define TK_TABLE kernels_amx
#define TK_NAME "amx"
// Batch sizes from which the level switches kernel, per storage (fp32, fp16, bf16, int8):
// {query-major from, packed from, AMX from}: below the AMX switch those of avx512bf16. One
// thread, CPU time (the machine shared, load ~18), N=100k, ms stream / AMX: bf16 d=384 B=1
// 10.8/9.1, B=4 14.3/9.5; d=768 B=1 23.4/20.8, B=4 24.7/17.2; int8 d=384 B=1 5.5/4.5, B=4
// 7.4/4.5; d=768 B=1 11.1/9.7, B=8 15.6/8.9; fp32 (rows converted to bf16 on the fly) d=768
// B=1 32.1/46.4, B=4 41.9/38.9, B=8 46.3/43.8, B=12 54.5/42.3. fp16 (no AMX-FP16 on this
// level: rows converted to bf16 on the fly, as fp32's; one thread, CPU time, load ~19, N=100k,
// ms stream / AMX): d=384 B=4 16.2/18.7, B=8 19.1/15.3, B=16 29.7/21.7, B=64 66.0/28.0; d=768
// B=4 27.9/29.7, B=8 37.9/32.1, B=16 51.8/34.8, B=64 156/68.6; N=50k, packed / AMX: d=768
// B=128 108/52.2, B=256 157/77.4.
#define TK_DEFAULT_PATHS {{24, 1 << 30, 32, 1 << 30}, {1 << 30, 128, 8, 24}, {8, 8, 1, 1}}
#include "amx_tiles.h"
#include "../topk_ip_kernels.h"
