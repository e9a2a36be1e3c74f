// topk_ip kernel bodies for one ISA level. Included once by each csrc/isa/topk_ip_<level>.cpp,
// which is compiled with that level's target flags and defines TK_TABLE (the exported table's
// name) and TK_NAME; TK_GENERIC forces the portable path whatever the flags.
//
// Everything is in an anonymous namespace (internal linkage), and no std:: template is used on
// shared types, so nothing compiled here can be merged by the linker with another level's copy
// (an AVX-512 copy of a helper must never be what the AVX2 or generic level calls).
//
// The kernels are in parts, included below in this order inside the anonymous namespace:
//  * csrc/topk_ip/common.h: the running top-k, conversions, exact re-score, the generic scan;
//  * csrc/topk_ip/avx512.h: AVX-512 families (TK_SIMD; BF16 / VNNI where the level has them);
//  * csrc/topk_ip/avx2.h: 256-bit families (TK_PAIRS2: the AVX2 level, and plain AVX-512's int8);
//  * csrc/topk_ip/amx.h: AMX tile scans (TK_AMX);
// this file keeps the feature macros and the level interface (choose_path, scan_range, the table).
//
// Kernel families (see csrc/topk_ip.cpp for the driver):
//  * stream: QB queries x RB rows, dot along d, split accumulators for 1-2 queries;
//  * packed: a 64-row tile transposed once, reused by every block of queries (GEMM-style);
//  * query-major (AVX-512 only): 16 queries per vector, corpus elements broadcast.
// AVX-512 uses BF16 vdpbf16ps and VNNI vpdpbusd where the level has them (approximate first
// passes, re-scored exactly by the driver); AVX2 widens fp16/bf16 to fp32 in registers and
// scores int8 with vpmaddwd on sign-extended int16 (16-bit products summed in pairs into
// int32: 2 * 127 * 127 per lane per step, no saturation possible).
#include "topk_ip_common.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(TK_GENERIC) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define TK_SIMD 1
#elif !defined(TK_GENERIC) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TK_AVX2 1
#endif
#if defined(TK_SIMD) && defined(__AVX512BF16__)
#define TK_BF16 1
#endif
#if defined(TK_SIMD) && defined(__AVX512VNNI__)
#define TK_VNNI 1
#endif
#if defined(TK_BF16) && defined(TK_VNNI) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define TK_AMX 1
#endif
// The AVX2 kernels (256-bit; int8 and quantised bf16 as int16 depth pairs through vpmaddwd)
// also serve the plain AVX-512 level, which has neither BF16 nor VNNI, for int8 (stream and
// packed, so its first pass stays one quantised-query pass) and for packed bf16; that level
// otherwise widens both to fp32 (forced avx512, 200k x 768, B = 256: int8 1.07x, bf16 0.99x of
// the anchors).
#if defined(TK_AVX2) || (defined(TK_SIMD) && !defined(TK_VNNI))
#define TK_PAIRS2 1
#endif
#if defined(TK_SIMD) || defined(TK_AVX2)
#include <immintrin.h>
#endif

namespace ragfast {
namespace topk_ip_common {
namespace {

#include "topk_ip/common.h"
#include "topk_ip/avx512.h"
#include "topk_ip/avx2.h"
#include "topk_ip/amx.h"

// ---------------------------------------------------------------------------- level interface

bool qmajor_supported(int kind) {
#ifdef TK_SIMD
  if (kind == kF32) return true;
#ifdef TK_BF16
  if (kind == kBF16) return true;
#endif
#ifdef TK_VNNI
  if (kind == kI8) return true;
#endif
#endif
  (void)kind;
  return false;
}

int choose_path(int kind, int64_t B, const Paths& paths) {
#if defined(TK_AMX)
  if (B >= paths.amx_min[kind] && amx_supported(kind)) return kAmx;
#endif
#if defined(TK_SIMD)
  if (B >= paths.packed_min[kind]) return kPacked;
  if (B >= paths.qmajor_min[kind]) return qmajor_supported(kind) ? kQmajor : kPacked;
  return kStream;
#elif defined(TK_AVX2)
  (void)paths.qmajor_min;  // no query-major family on AVX2 (16 registers)
  return B >= paths.packed_min[kind] ? kPacked : kStream;
#else
  (void)kind;
  (void)B;
  (void)paths;
  return kScalar;
#endif
}

int qmajor_per(int kind) {
#ifdef TK_BF16
  if (kind == kBF16) return 2;
#endif
#ifdef TK_VNNI
  if (kind == kI8) return 4;
#endif
  (void)kind;
  return 1;
}

int fetch_mult(int kind, int path) {
#if defined(TK_PAIRS2) || defined(TK_VNNI)
  // The bf16 packed passes quantise rows and queries (pack_tile2_bf16: int16 codes;
  // pack_tile_bf16q: int8 codes), coarser than vdpbf16ps, which rounds only the queries. With
  // twice the candidates the AVX2 pass returned exactly the bf16 rows' top 10 for 64 queries
  // over 200k x 768 unit vectors (recall@10 against fp32 0.989 -> 0.992 in the benchmark);
  // re-scoring 2k more rows per query is < 0.1% of the scan.
  if (kind == kBF16 && path == kPacked) return 2;
#endif
  (void)kind;
  (void)path;
  return 1;
}

int64_t scratch_floats(const Problem& p, int path) {
  // packed tiles (AVX-512: depth x 64 words; AVX2: 64 x d floats, then [B][64] partial sums
  // between depth chunks and 64 row factors), or one converted row
  const int64_t floats = int64_t(kTile) * (p.d + 1) + 64 + int64_t(kTile) * p.B;
#if defined(TK_AMX)
  if (path == kAmx) return imax(floats, (amx_scratch_bytes(p) + 3) / 4);
#endif
  (void)path;
  return floats;
}

void scan_range(const Problem& p, int path, int64_t r0, int64_t r1, TopK* tk, float* scratch, uint32_t* ran,
                float* sumsq) {
  (void)sumsq;
#if defined(TK_AMX)
  if (path == kAmx && amx_supported(p.kind)) {
    *ran |= 1u << kkAmx;
    return scan_amx(p, r0, r1, tk, scratch, sumsq);
  }
#endif
#if defined(TK_SIMD)
  switch (path) {
    case kPacked:
#if defined(TK_PAIRS2)
      if (p.kind == kBF16 || p.kind == kI8) return scan_packed2(p, r0, r1, tk, scratch, ran);
#endif
      return scan_packed(p, r0, r1, tk, scratch, ran);
    case kQmajor: *ran |= 1u << kkQmajor; return scan_qmajor(p, r0, r1, tk);
    case kStream:
#if defined(TK_PAIRS2)
      if (p.kind == kI8) {
        *ran |= 1u << kkStream2;
        return scan_stream2(p, r0, r1, tk);
      }
#endif
      *ran |= 1u << kkStream;
      return scan_stream(p, r0, r1, tk);
    default: break;
  }
#elif defined(TK_AVX2)
  switch (path) {
    case kPacked: return scan_packed2(p, r0, r1, tk, scratch, ran);
    case kStream: *ran |= 1u << kkStream2; return scan_stream2(p, r0, r1, tk);
    default: break;
  }
#endif
  *ran |= 1u << kkScalar;
  scan_generic(p, r0, r1, tk, scratch);
}

float dot_exact(const float* q, const void* row, int kind, int d, float scale) {
  return dot_exact_simd(q, row, kind, d, scale);
}

}  // namespace

const Kernels TK_TABLE = {
    TK_NAME,
    TK_DEFAULT_PATHS,
    &choose_path,
    &qmajor_per,
    &fetch_mult,
    &scratch_floats,
    &scan_range,
    &dot_exact,
};

}  // namespace topk_ip_common
}  // namespace ragfast
