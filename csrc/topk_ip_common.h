// Types shared by the topk_ip dispatcher (csrc/topk_ip.cpp) and its per-ISA kernel translation
// units (csrc/isa/topk_ip_<level>.cpp, each compiled with its own -m flags).
//
// Everything here is plain data with no inline functions: a type or inline function defined
// in several translation units compiled with different target flags would be merged by the
// linker into one copy, possibly the AVX-512 one, and then run on a CPU without AVX-512. The
// kernels themselves live in an anonymous namespace per level (csrc/topk_ip_kernels.h), so
// each level keeps its own copy; the only symbol a level exports is its `Kernels` table.
#pragma once
#include <cstdint>

#include "isa_compiled.h"

namespace ragfast {
namespace topk_ip_common {

enum Kind : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3 };
enum Path : int { kStream = 0, kQmajor = 1, kPacked = 2, kScalar = 3, kAmx = 4, kNumPaths = 5 };
constexpr int kTile = 64;  // rows per packed tile

// The kernels that can serve a scan, one bit each in the flags a scan sets (what ran, not what
// was asked for: tests assert it through _C.topk_ip_last). The names are in csrc/topk_ip.cpp.
enum KernelBit : int {
  kkScalar = 0,      // generic: one row at a time, compiler-vectorised
  kkStream = 1,      // AVX-512 stream (fp32 FMA, vdpbf16ps, vpdpbusd by storage)
  kkStream2 = 2,     // 256-bit stream (AVX2 level; int8 at the plain AVX-512 level)
  kkQmajor = 3,      // AVX-512 query-major
  kkPacked = 4,      // AVX-512 packed tile (fp32 FMA, bf16 pairs, int8 quads)
  kkPackedBf16q = 5, // AVX-512 VNNI packed over a bf16 tile quantised to int8 codes
  kkPacked2 = 6,     // 256-bit packed, tile widened to fp32
  kkPacked2Pairs = 7,  // 256-bit packed, int16 depth pairs (int8, quantised bf16)
  kkAmx = 8,         // AMX tiles (tdpbf16ps / tdpbssd)
  kNumKernelBits = 9
};

struct Hit {
  float s;
  int64_t id;
};

// Running top-`cap` of one query inside one thread, kept sorted best-first. `thr` is the score a
// candidate must reach: the floor (min_score or -inf) until the list is full, then its worst.
struct TopK {
  Hit* h;
  int n, cap;
  float thr;
  const int64_t* ex;  // sorted, unique excluded ids
  int nex;
};

// One search, with its queries prepared by the dispatcher in the layouts the level asked for.
struct Problem {
  int64_t B, N, d;
  int kind;
  const float* q;        // [B, d] contiguous fp32
  const char* base;      // corpus storage
  int64_t rs;            // row stride in elements of the storage type
  int esize;
  const float* scale;    // int8
  const int32_t* rowsum;  // int8
  int64_t qs;            // stride of qf (floats), padded to 16
  const float* qf;       // fp32 copy, zero padded
  int64_t qs16;          // stride of qh in uint16, padded to 32
  const uint16_t* qh;    // bf16 queries
  int64_t qs8;           // stride of qb in bytes, padded to 64
  const uint8_t* qb;     // int8 queries + 128 (VNNI: unsigned x signed)
  int64_t qsw;           // stride of qw in int16, padded to 32
  const int16_t* qw;     // int16 query codes (AVX2 vpmaddwd): int8 codes widened, or bf16 queries quantised
  const float* qdeq;     // query dequantisation factor per query (int8: padded to Bp)
  const float* qdeq8;    // int8 query codes' (qb) factor per query: int8 storage (= qdeq), or bf16 queries
  int32_t wrange;        // bf16: code range R of the AVX2 int16 packed pass (codes in [-R, R]); 0: not usable
  bool qmajor;
  int64_t Bp;            // B rounded up to 16
  const uint32_t* qt;    // query-major [depth][Bp]: fp32 bits, a bf16 pair or four int8 codes
                         // (AMX: the VNNI B operand, bf16 pairs or four signed int8 codes)
};

// Batch sizes from which a level switches kernel, per storage kind (fp32, fp16, bf16, int8).
struct Paths {
  int64_t qmajor_min[4];
  int64_t packed_min[4];
  int64_t amx_min[4];  // AMX tile kernels (amx level only)
};

// What one ISA level provides. Constant-initialised (no static constructor runs any code).
struct Kernels {
  const char* name;
  Paths defaults;
  int (*choose_path)(int kind, int64_t B, const Paths& paths);
  int (*qmajor_per)(int kind);  // depth elements per 32-bit word of the query-major layout
  int (*fetch_mult)(int kind, int path);  // over-fetch multiplier of the path's approximate pass
  int64_t (*scratch_floats)(const Problem& p, int path);
  // ran: the calling thread's flags, one bit (1 << KernelBit) per kernel that served the range;
  // sumsq (AMX fp32 pass only, else unused): the largest squared row norm the thread has met
  void (*scan)(const Problem& p, int path, int64_t r0, int64_t r1, TopK* tk, float* scratch, uint32_t* ran,
               float* sumsq);
  float (*dot_exact)(const float* q, const void* row, int kind, int d, float scale);
};

// Each compiled level's table (csrc/isa/topk_ip_<name>.cpp), named kernels_<name>.
#define RAGFAST_TOPK_IP_TABLE_(e, n) extern const Kernels kernels_##n;
RAGFAST_ISA_COMPILED(RAGFAST_TOPK_IP_TABLE_)
#undef RAGFAST_TOPK_IP_TABLE_

}  // namespace topk_ip_common
}  // namespace ragfast
