// topk_ip kernel bodies for one ISA level. Included once by each csrc/isa/topk_ip_<level>.cpp,
// which is compiled with that level's target flags and defines TK_TABLE (the exported table's
// name) and TK_NAME; TK_GENERIC forces the portable path whatever the flags.
//
// Everything is in an anonymous namespace (internal linkage), and no std:: template is used on
// shared types, so nothing compiled here can be merged by the linker with another level's copy
// (an AVX-512 copy of a helper must never be what the AVX2 or generic level calls).
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

constexpr float kNegInf = -__builtin_inff();
constexpr float kInf = __builtin_inff();

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

inline bool better(float s1, int64_t i1, float s2, int64_t i2) { return s1 > s2 || (s1 == s2 && i1 < i2); }

inline bool excluded(const TopK& t, int64_t id) {
  int64_t lo = 0, hi = t.nex;  // binary search in the sorted exclusion list
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (t.ex[mid] < id) lo = mid + 1; else hi = mid;
  }
  return lo < t.nex && t.ex[lo] == id;
}

void tk_insert(TopK& t, float s, int64_t id) {
  if (s == kNegInf) return;  // -inf marks an empty slot, never a hit
  if (t.n == t.cap && !better(s, id, t.h[t.n - 1].s, t.h[t.n - 1].id)) return;
  if (t.nex && excluded(t, id)) return;
  int j = t.n < t.cap ? t.n++ : t.cap - 1;
  while (j > 0 && better(s, id, t.h[j - 1].s, t.h[j - 1].id)) {
    t.h[j] = t.h[j - 1];
    --j;
  }
  t.h[j] = Hit{s, id};
  if (t.n == t.cap) t.thr = t.h[t.cap - 1].s;
}

inline void tk_push(TopK& t, float s, int64_t id) {
  if (!(s >= t.thr)) return;  // the common case; also rejects NaN
  tk_insert(t, s, id);
}

inline const char* row_of(const Problem& p, int64_t r) { return p.base + (r * p.rs) * p.esize; }

// The packed kernels take queries in blocks of 6 (then the 1-5 left over), the block size a
// compile-time constant: run(QBlock<QB>{}, b0) for each block.
template <int N> struct QBlock { static constexpr int value = N; };
template <class Run>
inline void for_query_blocks(int64_t B, Run run) {
  int64_t b = 0;
  for (; b + 6 <= B; b += 6) run(QBlock<6>{}, b);
  switch (B - b) {
    case 5: run(QBlock<5>{}, b); break;
    case 4: run(QBlock<4>{}, b); break;
    case 3: run(QBlock<3>{}, b); break;
    case 2: run(QBlock<2>{}, b); break;
    case 1: run(QBlock<1>{}, b); break;
    default: break;
  }
}

// ---------------------------------------------------------------------------- scalar helpers

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}


#if defined(TK_AVX2) || defined(TK_SIMD)
// ---------------------------------------------------------------------------- 256-bit helpers
// (AVX2 + FMA + F16C: the AVX2 level, and the AVX-512 levels, which are compiled with them too)

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Eight consecutive elements of a row as fp32 (fp32; fp16 through F16C; bf16 by a 16-bit shift;
// int8 codes). With n < 8 only the first n are read (never past the row), the rest are 0.
template <int KIND>
inline __m256 load8(const char* row, int64_t j, int64_t n) {
  if (KIND == kF32) {
    const float* r = reinterpret_cast<const float*>(row) + j;
    if (n >= 8) return _mm256_loadu_ps(r);
    float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, r, size_t(n) * 4);
    return _mm256_loadu_ps(buf);
  } else if (KIND == kF16 || KIND == kBF16) {
    const uint16_t* r = reinterpret_cast<const uint16_t*>(row) + j;
    __m128i h;
    if (n >= 8) {
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r));
    } else {
      uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::memcpy(buf, r, size_t(n) * 2);
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
    }
    if (KIND == kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const int8_t* r = reinterpret_cast<const int8_t*>(row) + j;
    int64_t v = 0;
    std::memcpy(&v, r, size_t(n >= 8 ? 8 : n));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(v)));
  }
}

// 8 x 8 transpose of fp32 registers (the standard unpack / shuffle / lane-permute network).
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Rows t0+r0 .. t0+r0+7 of the corpus as fp32 (int8 dequantised; rows at or past `rows` are
// zero), eight depths at a time through a register transpose: store(j, v) receives the eight
// rows' values at depth j. The packed kernels lay tiles out depth-major; element-wise stores,
// one per 4-byte value at a 64- or 256-byte stride, cost a fifth of the GEMM's time at d = 768.
template <class Store>
inline void pack_rows8(const Problem& p, int64_t t0, int rows, int r0, Store store) {
  const int64_t d = p.d;
  const char* row[8];
  __m256 sc[8];
  for (int i = 0; i < 8; ++i) {
    const bool live = r0 + i < rows;
    row[i] = live ? row_of(p, t0 + r0 + i) : nullptr;
    sc[i] = _mm256_set1_ps(p.kind == kI8 && live ? p.scale[t0 + r0 + i] : 1.f);
  }
  for (int64_t j = 0; j < d; j += 8) {
    const int64_t n = imin(8, d - j);
    __m256 v[8];
    for (int i = 0; i < 8; ++i) {
      if (!row[i]) {
        v[i] = _mm256_setzero_ps();
        continue;
      }
      switch (p.kind) {
        case kF32: v[i] = load8<kF32>(row[i], j, n); break;
        case kF16: v[i] = load8<kF16>(row[i], j, n); break;
        case kBF16: v[i] = load8<kBF16>(row[i], j, n); break;
        default: v[i] = _mm256_mul_ps(load8<kI8>(row[i], j, n), sc[i]); break;
      }
    }
    transpose8(v);
    for (int64_t u = 0; u < n; ++u) store(j + u, v[u]);
  }
}
#endif

// Exact fp32 dot of a query (unpadded, d floats) with one stored row (dequantised by `scale`
// for int8): the re-scoring of approximate candidates.
float dot_exact_simd(const float* q, const void* row, int kind, int d, float scale) {
#if defined(TK_SIMD)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int j = 0;
  auto load = [&](int jj, __mmask16 m) -> __m512 {
    switch (kind) {
      case kF32:
        return _mm512_maskz_loadu_ps(m, static_cast<const float*>(row) + jj);
      case kF16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + jj));
      case kBF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + jj)), 16));
      default:
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, static_cast<const int8_t*>(row) + jj)));
    }
  };
  for (; j + 32 <= d; j += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), load(j, 0xffff), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + j + 16), load(j + 16, 0xffff), acc1);
  }
  for (; j < d; j += 16) {
    __mmask16 m = d - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (d - j)) - 1);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + j), load(j, m), acc0);
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(TK_AVX2)
  const char* r = static_cast<const char*>(row);
  const char* qc = reinterpret_cast<const char*>(q);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int j = 0;
  auto load = [&](int jj, int n) -> __m256 {
    switch (kind) {
      case kF32: return load8<kF32>(r, jj, n);
      case kF16: return load8<kF16>(r, jj, n);
      case kBF16: return load8<kBF16>(r, jj, n);
      default: return load8<kI8>(r, jj, n);
    }
  };
  for (; j + 16 <= d; j += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load(j, 8), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), load(j + 8, 8), acc1);
  }
  for (; j < d; j += 8) acc0 = _mm256_fmadd_ps(load8<kF32>(qc, j, d - j), load(j, d - j), acc0);
  float s = hsum8(_mm256_add_ps(acc0, acc1));
#else
  float s = 0.f;
  for (int j = 0; j < d; ++j) {
    float v;
    switch (kind) {
      case kF32: v = static_cast<const float*>(row)[j]; break;
      case kF16: v = half_to_float(static_cast<const uint16_t*>(row)[j]); break;
      case kBF16: v = bf16_to_float(static_cast<const uint16_t*>(row)[j]); break;
      default: v = float(static_cast<const int8_t*>(row)[j]); break;
    }
    s += q[j] * v;
  }
#endif
  return kind == kI8 ? s * scale : s;
}

// ---------------------------------------------------------------------------- generic scan
// Portable and compiler-vectorised: each row is converted to fp32 once into `deq` (zero padded
// to a multiple of 8), then dotted with every query in 8 independent partial sums, which the
// compiler turns into SIMD at whatever the target's width is (SSE2, NEON, ...).

void scan_generic(const Problem& p, int64_t r0, int64_t r1, TopK* tk, float* deq) {
  const int64_t d = p.d, d8 = (d + 7) / 8 * 8;
  for (int64_t j = d; j < d8; ++j) deq[j] = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const char* row = row_of(p, r);
    switch (p.kind) {
      case kF32: std::memcpy(deq, row, size_t(d) * 4); break;
      case kF16:
        for (int64_t j = 0; j < d; ++j) deq[j] = half_to_float(reinterpret_cast<const uint16_t*>(row)[j]);
        break;
      case kBF16:
        for (int64_t j = 0; j < d; ++j) deq[j] = bf16_to_float(reinterpret_cast<const uint16_t*>(row)[j]);
        break;
      default: {
        const float sc = p.scale[r];
        for (int64_t j = 0; j < d; ++j) deq[j] = float(reinterpret_cast<const int8_t*>(row)[j]) * sc;
      }
    }
    for (int64_t b = 0; b < p.B; ++b) {
      const float* q = p.qf + b * p.qs;  // zero padded to a multiple of 16
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t j = 0; j < d8; j += 8)
        for (int u = 0; u < 8; ++u) acc[u] += q[j + u] * deq[j + u];
      const float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
      tk_push(tk[b], s, r);
    }
  }
}

#ifdef TK_SIMD
// ---------------------------------------------------------------------------- stream kernels
// Scores of QB queries x RB consecutive rows, dot along d; RB independent accumulator chains per
// query hide the FMA latency when QB is 1.

inline __mmask16 m16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }
inline __mmask32 m32(int64_t n) { return n >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1); }
inline __mmask64 m64(int64_t n) { return n >= 64 ? ~__mmask64(0) : __mmask64((uint64_t(1) << n) - 1); }

// Horizontal sums of 16 vectors at once: result lane p = sum of the lanes of v[p]. A shuffle
// tree (15 adds, 30 shuffles) instead of 16 separate reductions (~8 ops each); with d = 384 and
// one query the separate reductions cost about as much as the dot products themselves.
// The tree yields lane 4j+e = sum(input 4e+j), so the inputs are fed transposed.
inline __m512 as_ps(__m512 a) { return a; }
inline __m512 as_ps(__m512i a) { return _mm512_castsi512_ps(a); }
template <class V> inline V from_ps(__m512 a);
template <> inline __m512 from_ps<__m512>(__m512 a) { return a; }
template <> inline __m512i from_ps<__m512i>(__m512 a) { return _mm512_castps_si512(a); }

template <class V, class Add>
inline V reduce16_tree(const V* x, Add add) {
  auto f4 = [](V a, V b, int imm) -> V {
    __m512 fa = as_ps(a), fb = as_ps(b), r;
    switch (imm) {
      case 0x44: r = _mm512_shuffle_f32x4(fa, fb, 0x44); break;
      case 0xEE: r = _mm512_shuffle_f32x4(fa, fb, 0xEE); break;
      case 0x88: r = _mm512_shuffle_f32x4(fa, fb, 0x88); break;
      default: r = _mm512_shuffle_f32x4(fa, fb, 0xDD); break;
    }
    return from_ps<V>(r);
  };
  auto f1 = [](V a, V b, bool even) -> V {
    __m512 fa = as_ps(a), fb = as_ps(b);
    __m512 r = even ? _mm512_shuffle_ps(fa, fb, 0x88) : _mm512_shuffle_ps(fa, fb, 0xDD);
    return from_ps<V>(r);
  };
  V v[16];
  for (int p = 0; p < 16; ++p) v[p] = x[(p % 4) * 4 + p / 4];  // transpose the 4x4 index grid
  V s[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) s[i] = add(f4(v[2 * i], v[2 * i + 1], 0x44), f4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i) u[i] = add(f4(s[2 * i], s[2 * i + 1], 0x88), f4(s[2 * i], s[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) w[i] = add(f1(u[2 * i], u[2 * i + 1], true), f1(u[2 * i], u[2 * i + 1], false));
  return add(f1(w[0], w[1], true), f1(w[0], w[1], false));
}
inline __m512 reduce16(const __m512* x) {
  return reduce16_tree<__m512>(x, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}
inline __m512i reduce16(const __m512i* x) {
  return reduce16_tree<__m512i>(x, [](__m512i a, __m512i b) { return _mm512_add_epi32(a, b); });
}

// Write the QB x RB sums of `acc` to out[b * RB + i].
template <int QB, int RB>
inline void finish_f(const __m512 (&acc)[QB][RB], float* out) {
  if constexpr (QB * RB == 16) {
    _mm512_storeu_ps(out, reduce16(&acc[0][0]));
  } else {
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) out[b * RB + i] = _mm512_reduce_add_ps(acc[b][i]);
  }
}

template <int KIND>
inline __m512 load_f(const char* row, int64_t j, __mmask16 m, bool full) {
  if (KIND == kF32) {
    const float* r = reinterpret_cast<const float*>(row) + j;
    return full ? _mm512_loadu_ps(r) : _mm512_maskz_loadu_ps(m, r);
  } else if (KIND == kI8) {
    const int8_t* r = reinterpret_cast<const int8_t*>(row) + j;
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(full ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(r))
                                                        : _mm_maskz_loadu_epi8(m, r)));
  } else {
    const uint16_t* r = reinterpret_cast<const uint16_t*>(row) + j;
    __m256i h = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)) : _mm256_maskz_loadu_epi16(m, r);
    if (KIND == kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// S > 1 splits d over S accumulator sets per (query, row): with one query, 4 rows x 4 splits
// keep 16 FMA chains in flight while reading only 4 row streams. 16 row streams (RB = 16)
// measured 1.7x slower on int8 at batch 1 (9.6 vs 5.6 ms per 200k rows at batch 4, which
// reads 4 streams): the hardware prefetcher tracks few concurrent strided streams.
template <int QB, int RB, int S, class V, class Add>
inline void fold_splits(V (&acc)[S][QB][RB], Add add) {
  for (int t = 1; t < S; ++t)
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) acc[0][b][i] = add(acc[0][b][i], acc[t][b][i]);
}

// fp32 / fp16 (and bf16 without AVX512_BF16): convert to fp32 in registers, FMA with fp32 query.
template <int KIND, int QB, int RB, int S>
inline void sk_float(const Problem& p, int64_t b0, int64_t r0, float* out) {
  __m512 acc[S][QB][RB];
  for (int t = 0; t < S; ++t)
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) acc[t][b][i] = _mm512_setzero_ps();
  const char* rows[RB];
  for (int i = 0; i < RB; ++i) rows[i] = row_of(p, r0 + i);
  const float* q = p.qf + b0 * p.qs;
  const int64_t d = p.d;
  auto chunk = [&](int t, int64_t j, __mmask16 m, bool full) __attribute__((always_inline)) {
    __m512 rv[RB];
    for (int i = 0; i < RB; ++i) rv[i] = load_f<KIND>(rows[i], j, m, full);
    for (int b = 0; b < QB; ++b) {
      __m512 qv = _mm512_loadu_ps(q + b * p.qs + j);  // zero padded past d
      for (int i = 0; i < RB; ++i) acc[t][b][i] = _mm512_fmadd_ps(qv, rv[i], acc[t][b][i]);
    }
  };
  int64_t j = 0;
  for (; j + 16 * S <= d; j += 16 * S)
    for (int t = 0; t < S; ++t) chunk(t, j + 16 * t, 0, true);
  for (; j + 16 <= d; j += 16) chunk(0, j, 0, true);
  if (j < d) chunk(0, j, m16(d - j), false);
  fold_splits<QB, RB, S>(acc, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
  finish_f<QB, RB>(acc[0], out);
  if constexpr (KIND == kI8)  // int8 without VNNI: codes widened to fp32, then the row scale
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) out[b * RB + i] *= p.scale[r0 + i];
}

#ifdef TK_BF16
template <int QB, int RB, int S>
inline void sk_bf16(const Problem& p, int64_t b0, int64_t r0, float* out) {
  __m512 acc[S][QB][RB];
  for (int t = 0; t < S; ++t)
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) acc[t][b][i] = _mm512_setzero_ps();
  const uint16_t* rows[RB];
  for (int i = 0; i < RB; ++i) rows[i] = reinterpret_cast<const uint16_t*>(row_of(p, r0 + i));
  const uint16_t* q = p.qh + b0 * p.qs16;
  const int64_t d = p.d;
  auto chunk = [&](int t, int64_t j, bool full) __attribute__((always_inline)) {
    __m512i rv[RB];
    if (full) {
      for (int i = 0; i < RB; ++i) rv[i] = _mm512_loadu_si512(rows[i] + j);
    } else {
      __mmask32 m = m32(d - j);
      for (int i = 0; i < RB; ++i) rv[i] = _mm512_maskz_loadu_epi16(m, rows[i] + j);
    }
    for (int b = 0; b < QB; ++b) {
      __m512i qv = _mm512_loadu_si512(q + b * p.qs16 + j);
      for (int i = 0; i < RB; ++i) acc[t][b][i] = _mm512_dpbf16_ps(acc[t][b][i], (__m512bh)qv, (__m512bh)rv[i]);
    }
  };
  int64_t j = 0;
  for (; j + 32 * S <= d; j += 32 * S)
    for (int t = 0; t < S; ++t) chunk(t, j + 32 * t, true);
  for (; j + 32 <= d; j += 32) chunk(0, j, true);
  if (j < d) chunk(0, j, false);
  fold_splits<QB, RB, S>(acc, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
  finish_f<QB, RB>(acc[0], out);
}
#endif

#ifdef TK_VNNI
inline __m512i _mm512_rem_epu32_fallback(__m512i x, int m) { return _mm512_and_si512(x, _mm512_set1_epi32(m - 1)); }
inline __m512i _mm512_div_fallback(__m512i x, int m) { return _mm512_srlv_epi32(x, _mm512_set1_epi32(__builtin_ctz(unsigned(m)))); }

template <int QB, int RB, int S>
inline void sk_i8(const Problem& p, int64_t b0, int64_t r0, float* out) {
  __m512i accs[S][QB][RB];
  for (int t = 0; t < S; ++t)
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) accs[t][b][i] = _mm512_setzero_si512();
  const int8_t* rows[RB];
  for (int i = 0; i < RB; ++i) rows[i] = reinterpret_cast<const int8_t*>(row_of(p, r0 + i));
  const uint8_t* q = p.qb + b0 * p.qs8;
  const int64_t d = p.d;
  auto chunk = [&](int t, int64_t j, bool full) __attribute__((always_inline)) {
    __m512i rv[RB];
    if (full) {
      for (int i = 0; i < RB; ++i) rv[i] = _mm512_loadu_si512(rows[i] + j);
    } else {
      __mmask64 m = m64(d - j);
      for (int i = 0; i < RB; ++i) rv[i] = _mm512_maskz_loadu_epi8(m, rows[i] + j);
    }
    for (int b = 0; b < QB; ++b) {
      __m512i qv = _mm512_loadu_si512(q + b * p.qs8 + j);
      for (int i = 0; i < RB; ++i) accs[t][b][i] = _mm512_dpbusd_epi32(accs[t][b][i], qv, rv[i]);
    }
  };
  int64_t j = 0;
  for (; j + 64 * S <= d; j += 64 * S)
    for (int t = 0; t < S; ++t) chunk(t, j + 64 * t, true);
  for (; j + 64 <= d; j += 64) chunk(0, j, true);
  if (j < d) chunk(0, j, false);
  fold_splits<QB, RB, S>(accs, [](__m512i x, __m512i y) { return _mm512_add_epi32(x, y); });
  auto& acc = accs[0];
  if constexpr (QB * RB == 16) {
    // lane L = (query L / RB, row L % RB): spread the per-row and per-query factors to match
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i rowi = _mm512_rem_epu32_fallback(lane, RB), qi = _mm512_div_fallback(lane, RB);
    __m512i rsum = _mm512_permutexvar_epi32(rowi, _mm512_maskz_loadu_epi32(__mmask16((1u << RB) - 1), p.rowsum + r0));
    __m512 rsc = _mm512_permutexvar_ps(rowi, _mm512_maskz_loadu_ps(__mmask16((1u << RB) - 1), p.scale + r0));
    __m512 qd = _mm512_permutexvar_ps(qi, _mm512_maskz_loadu_ps(__mmask16((1u << QB) - 1), p.qdeq + b0));
    __m512i dot = _mm512_sub_epi32(reduce16(&acc[0][0]), _mm512_slli_epi32(rsum, 7));
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(rsc, qd)));
  } else {
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) {
        int64_t r = r0 + i;
        int32_t dot = _mm512_reduce_add_epi32(acc[b][i]) - 128 * p.rowsum[r];
        out[b * RB + i] = float(dot) * p.scale[r] * p.qdeq[b0 + b];
      }
  }
}
#endif

template <int QB, int RB, int S>
inline void stream_block(const Problem& p, int64_t b0, int64_t r0, float* out) {
  switch (p.kind) {
    case kF32: sk_float<kF32, QB, RB, S>(p, b0, r0, out); break;
    case kF16: sk_float<kF16, QB, RB, S>(p, b0, r0, out); break;
#ifdef TK_BF16
    case kBF16: sk_bf16<QB, RB, S>(p, b0, r0, out); break;
#else
    case kBF16: sk_float<kBF16, QB, RB, S>(p, b0, r0, out); break;
#endif
#ifdef TK_VNNI
    case kI8: sk_i8<QB, RB, S>(p, b0, r0, out); break;
#else
    case kI8: sk_float<kI8, QB, RB, S>(p, b0, r0, out); break;
#endif
    default: break;
  }
}

template <int QB, int RB>
void stream_rows(const Problem& p, int64_t b0, int64_t r0, int64_t r1, TopK* tk) {
  // QB x RB x S = 2 to 16 accumulators (independent FMA chains). One query over single rows
  // keeps 2 (32 floats a step, as the AVX2 level's 4 x 8): with 8, fp32 at B = 1 ran ~1.1x slower
  // than the AVX2 level on Zen 4, with 2 at par.
  constexpr int S = RB == 1 ? (QB == 1 ? 2 : QB == 2 ? 4 : 2) : (QB == 1 ? 4 : QB == 2 ? 2 : 1);
  alignas(64) float out[QB * RB];
  int64_t r = r0;
  for (; r + RB <= r1; r += RB) {
    stream_block<QB, RB, S>(p, b0, r, out);
    if constexpr (QB * RB == 16) {
      // one vector compare against each lane's query threshold; pushes are rare
      alignas(64) float thr[16];
      for (int L = 0; L < 16; ++L) thr[L] = tk[b0 + L / RB].thr;
      __mmask16 m = _mm512_cmp_ps_mask(_mm512_load_ps(out), _mm512_load_ps(thr), _CMP_GE_OQ);
      while (m) {
        const int L = __builtin_ctz(m);
        m &= m - 1;
        tk_push(tk[b0 + L / RB], out[L], r + L % RB);
      }
    } else {
      for (int b = 0; b < QB; ++b)
        for (int i = 0; i < RB; ++i) tk_push(tk[b0 + b], out[b * RB + i], r + i);
    }
  }
  for (; r < r1; ++r) {
    stream_block<QB, 1, S>(p, b0, r, out);
    for (int b = 0; b < QB; ++b) tk_push(tk[b0 + b], out[b], r);
  }
}

void scan_stream(const Problem& p, int64_t r0, int64_t r1, TopK* tk) {
  // Rows in L1-sized tiles, all query blocks over one tile before the next: the corpus is read
  // from memory once whatever B is.
  const int64_t rowbytes = p.d * p.esize;
  // a multiple of the 4-row micro-block, so only the range's last rows take the 1-row kernel
  const int64_t tile = imax(8, imin(256, (24 << 10) / imax(rowbytes, 1))) / 4 * 4;
  for (int64_t t0 = r0; t0 < r1; t0 += tile) {
    const int64_t t1 = imin(r1, t0 + tile);
    // The first query block brings the tile in from memory one row at a time: 4 rows side by
    // side ran at ~0.5x the bandwidth of a row-at-a-time scan on Zen 4. Later blocks find the
    // tile in L1, where 4-row blocks reuse each query load 4 times. One thread, 200k x 384
    // fp32, ms before -> after: B=1 25 -> 12, B=2 26 -> 15, B=4 28 -> 17, B=8 36 -> 34.
    // The first block is a pair, as on AVX2: a block of 4 queries over single rows ran 1.3x
    // slower than the AVX2 level's pair at B = 4 (one thread, 200k x 384, same run).
    int64_t b = 0;
    if (p.B >= 4) {
      stream_rows<2, 1>(p, 0, t0, t1, tk);
      b = 2;
    }
    for (; b + 4 <= p.B; b += 4) stream_rows<4, 4>(p, b, t0, t1, tk);
    const bool first = b == 0;
    switch (p.B - b) {
      case 3: first ? stream_rows<3, 1>(p, b, t0, t1, tk) : stream_rows<3, 4>(p, b, t0, t1, tk); break;
      case 2: first ? stream_rows<2, 1>(p, b, t0, t1, tk) : stream_rows<2, 4>(p, b, t0, t1, tk); break;
      case 1: first ? stream_rows<1, 1>(p, b, t0, t1, tk) : stream_rows<1, 4>(p, b, t0, t1, tk); break;
      default: break;
    }
  }
}

// ---------------------------------------------------------------------------- packed kernels
// A 64-row tile is transposed once into `P` (depth-major: for each depth step, 64 rows) and
// reused by every query block. Depth step: 1 float (fp32/fp16/bf16-as-fp32), a pair of bf16,
// or four int8 codes (one 32-bit lane each).

// Whether the packed tile holds 32-bit lanes of several codes (bf16 pairs, int8 quads).
bool packed_lanes(const Problem& p) {
#ifdef TK_BF16
  if (p.kind == kBF16) return true;
#endif
#ifdef TK_VNNI
  if (p.kind == kI8) return true;
#endif
  (void)p;
  return false;
}

int packed_depth(const Problem& p) {
#ifdef TK_BF16
  if (p.kind == kBF16) return int((p.d + 1) / 2);
#endif
#ifdef TK_VNNI
  if (p.kind == kI8) return int((p.d + 3) / 4);
#endif
  return int(p.d);
}

// 16 x 16 transpose of 32-bit elements: v[i] holds row i on entry, column i on exit.
inline void transpose16(__m512i (&v)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  // u[4i + c], 128-bit lane k: rows 4i .. 4i+3 at column 4k + c
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), s1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), s3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    v[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    v[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    v[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    v[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// A tile of 32-bit lanes holding `per` codes each (bf16 pairs, int8 quads), depth-major
// ([lane][64 rows]; P 64-byte aligned), 16 rows x 16 lanes at a time through transpose16, so
// every store is a whole cache line. lanes16(r, row, j, n) gives row r's 16 lanes from element
// j, of which n elements are real (the rest 0). Rows past `rows` are zero. One 4-byte store per
// lane and row, 256 bytes apart, packed a 64 x 768 int8 tile at a third of the speed once the
// tile (48 KB) outgrew L1.
template <class Lanes16>
inline void pack_lanes16(const Problem& p, int64_t t0, int rows, uint32_t* P, int per, Lanes16 lanes16) {
  const int64_t d = p.d, D = (d + per - 1) / per, step = 16 * per;
  for (int r0 = 0; r0 < kTile; r0 += 16) {
    const char* row[16];
    for (int i = 0; i < 16; ++i) row[i] = r0 + i < rows ? row_of(p, t0 + r0 + i) : nullptr;
    for (int64_t j = 0; j < d; j += step) {
      __m512i v[16];
      for (int i = 0; i < 16; ++i)
        v[i] = row[i] ? lanes16(r0 + i, row[i], j, imin(step, d - j)) : _mm512_setzero_si512();
      transpose16(v);
      const int64_t nl = imin(16, D - j / per);
      for (int64_t l = 0; l < nl; ++l) _mm512_store_si512(P + (j / per + l) * kTile + r0, v[l]);
    }
  }
}

void pack_tile(const Problem& p, int64_t t0, int rows, void* P) {
  if (packed_lanes(p)) {
    // bf16 pairs or int8 quads: 64 bytes of a row are its 16 lanes
    const int per = p.kind == kBF16 ? 2 : 4;
    pack_lanes16(p, t0, rows, static_cast<uint32_t*>(P), per, [&](int, const char* row, int64_t j, int64_t n) {
      return _mm512_maskz_loadu_epi8(m64(n * p.esize), row + j * p.esize);
    });
    return;
  }
  float* out = static_cast<float*>(P);
  for (int r0 = 0; r0 < kTile; r0 += 8)
    pack_rows8(p, t0, rows, r0, [&](int64_t j, __m256 v) { _mm256_store_ps(out + j * kTile + r0, v); });
}

// Push 16 scores (rows t0 + g*16 + lane) of one query, after a vector threshold test.
inline void push16(TopK& t, __m512 sc, int64_t row0, __mmask16 valid) {
  __mmask16 m = _mm512_cmp_ps_mask(sc, _mm512_set1_ps(t.thr), _CMP_GE_OQ) & valid;
  if (!m) return;
  alignas(64) float buf[16];
  _mm512_store_ps(buf, sc);
  while (m) {
    int i = __builtin_ctz(m);
    m &= m - 1;
    tk_push(t, buf[i], row0 + i);
  }
}

template <int QB>
void pk_float(const Problem& p, const float* P, int64_t b0, int64_t t0, int rows, TopK* tk) {
  __m512 acc[QB][4];
  for (int b = 0; b < QB; ++b)
    for (int g = 0; g < 4; ++g) acc[b][g] = _mm512_setzero_ps();
  const float* q = p.qf + b0 * p.qs;
  const int64_t d = p.d;
  for (int64_t j = 0; j < d; ++j) {
    const float* pj = P + j * kTile;
    __m512 v0 = _mm512_load_ps(pj), v1 = _mm512_load_ps(pj + 16), v2 = _mm512_load_ps(pj + 32),
           v3 = _mm512_load_ps(pj + 48);
    for (int b = 0; b < QB; ++b) {
      __m512 qv = _mm512_set1_ps(q[b * p.qs + j]);
      acc[b][0] = _mm512_fmadd_ps(qv, v0, acc[b][0]);
      acc[b][1] = _mm512_fmadd_ps(qv, v1, acc[b][1]);
      acc[b][2] = _mm512_fmadd_ps(qv, v2, acc[b][2]);
      acc[b][3] = _mm512_fmadd_ps(qv, v3, acc[b][3]);
    }
  }
  // Spill once through a buffer: indexing the accumulators with the runtime group count
  // below would otherwise make GCC keep them on the stack inside the hot loop (measured: every
  // FMA paired with a load and a store).
  alignas(64) float buf[QB][4][16];
#pragma GCC unroll 32
  for (int b = 0; b < QB; ++b)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) _mm512_store_ps(buf[b][g], acc[b][g]);
  for (int g = 0; g < 4 && g * 16 < rows; ++g) {
    __mmask16 valid = m16(rows - g * 16);
    for (int b = 0; b < QB; ++b) push16(tk[b0 + b], _mm512_load_ps(buf[b][g]), t0 + g * 16, valid);
  }
}

#ifdef TK_BF16
template <int QB>
void pk_bf16(const Problem& p, const uint32_t* P, int D, int64_t b0, int64_t t0, int rows, TopK* tk) {
  __m512 acc[QB][4];
  for (int b = 0; b < QB; ++b)
    for (int g = 0; g < 4; ++g) acc[b][g] = _mm512_setzero_ps();
  const uint32_t* q = reinterpret_cast<const uint32_t*>(p.qh + b0 * p.qs16);
  const int64_t qs = p.qs16 / 2;
  for (int j = 0; j < D; ++j) {
    const uint32_t* pj = P + int64_t(j) * kTile;
    __m512i v0 = _mm512_load_si512(pj), v1 = _mm512_load_si512(pj + 16), v2 = _mm512_load_si512(pj + 32),
            v3 = _mm512_load_si512(pj + 48);
    for (int b = 0; b < QB; ++b) {
      __m512i qv = _mm512_set1_epi32(int(q[b * qs + j]));
      acc[b][0] = _mm512_dpbf16_ps(acc[b][0], (__m512bh)qv, (__m512bh)v0);
      acc[b][1] = _mm512_dpbf16_ps(acc[b][1], (__m512bh)qv, (__m512bh)v1);
      acc[b][2] = _mm512_dpbf16_ps(acc[b][2], (__m512bh)qv, (__m512bh)v2);
      acc[b][3] = _mm512_dpbf16_ps(acc[b][3], (__m512bh)qv, (__m512bh)v3);
    }
  }
  // Spill once through a buffer: indexing the accumulators with the runtime group count
  // below would otherwise make GCC keep them on the stack inside the hot loop (measured: every
  // FMA paired with a load and a store).
  alignas(64) float buf[QB][4][16];
#pragma GCC unroll 32
  for (int b = 0; b < QB; ++b)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) _mm512_store_ps(buf[b][g], acc[b][g]);
  for (int g = 0; g < 4 && g * 16 < rows; ++g) {
    __mmask16 valid = m16(rows - g * 16);
    for (int b = 0; b < QB; ++b) push16(tk[b0 + b], _mm512_load_ps(buf[b][g]), t0 + g * 16, valid);
  }
}
#endif

#ifdef TK_VNNI
// rsum / rsc: the tile's rows' code sums and dequantisation factors (int8 storage: its own
// arrays at the tile; bf16: the quantised tile's, pack_tile_bf16q)
template <int QB>
void pk_i8(const Problem& p, const uint32_t* P, int D, const int32_t* rsum_t, const float* rsc_t, int64_t b0, int64_t t0,
           int rows, TopK* tk) {
  __m512i acc[QB][4];
  for (int b = 0; b < QB; ++b)
    for (int g = 0; g < 4; ++g) acc[b][g] = _mm512_setzero_si512();
  const uint32_t* q = reinterpret_cast<const uint32_t*>(p.qb + b0 * p.qs8);
  const int64_t qs = p.qs8 / 4;
  for (int j = 0; j < D; ++j) {
    const uint32_t* pj = P + int64_t(j) * kTile;
    __m512i v0 = _mm512_load_si512(pj), v1 = _mm512_load_si512(pj + 16), v2 = _mm512_load_si512(pj + 32),
            v3 = _mm512_load_si512(pj + 48);
    for (int b = 0; b < QB; ++b) {
      __m512i qv = _mm512_set1_epi32(int(q[b * qs + j]));
      acc[b][0] = _mm512_dpbusd_epi32(acc[b][0], qv, v0);
      acc[b][1] = _mm512_dpbusd_epi32(acc[b][1], qv, v1);
      acc[b][2] = _mm512_dpbusd_epi32(acc[b][2], qv, v2);
      acc[b][3] = _mm512_dpbusd_epi32(acc[b][3], qv, v3);
    }
  }
  alignas(64) int32_t buf[QB][4][16];  // see pk_float: keeps the accumulators in registers
#pragma GCC unroll 32
  for (int b = 0; b < QB; ++b)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) _mm512_store_si512(buf[b][g], acc[b][g]);
  for (int g = 0; g < 4 && g * 16 < rows; ++g) {
    __mmask16 valid = m16(rows - g * 16);
    const int64_t r0 = t0 + g * 16;
    __m512i rsum = _mm512_maskz_loadu_epi32(valid, rsum_t + g * 16);
    __m512 rscale = _mm512_maskz_loadu_ps(valid, rsc_t + g * 16);
    __m512i off = _mm512_slli_epi32(rsum, 7);  // 128 * rowsum
    for (int b = 0; b < QB; ++b) {
      __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(buf[b][g]), off)),
                                _mm512_mul_ps(rscale, _mm512_set1_ps(p.qdeq8[b0 + b])));
      push16(tk[b0 + b], sc, r0, valid);
    }
  }
}
#endif

template <int QB>
void packed_block(const Problem& p, const void* P, int D, int64_t b0, int64_t t0, int rows, TopK* tk) {
#ifdef TK_BF16
  if (p.kind == kBF16) return pk_bf16<QB>(p, static_cast<const uint32_t*>(P), D, b0, t0, rows, tk);
#endif
#ifdef TK_VNNI
  if (p.kind == kI8) return pk_i8<QB>(p, static_cast<const uint32_t*>(P), D, p.rowsum + t0, p.scale + t0, b0, t0, rows, tk);
#endif
  pk_float<QB>(p, static_cast<const float*>(P), b0, t0, rows, tk);
}

#ifdef TK_VNNI
// bf16 through VNNI: a tile quantised per row to int8 codes (against the row's largest
// |value|), four codes per lane as the int8 storage's tile, scored by pk_i8 against the
// queries' int8 codes: vpdpbusd makes 64 multiply-adds per instruction, vdpbf16ps 32. An
// approximate first pass, as vdpbf16ps's already is; the driver re-scores twice the
// candidates (fetch_mult) exactly. Returns false, packing nothing, when a row holds an inf or
// a NaN (the caller packs that tile as bf16 pairs).
bool pack_tile_bf16q(const Problem& p, int64_t t0, int rows, uint32_t* P, int32_t* rsum, float* rsc) {
  const int64_t d = p.d;
  alignas(64) float inv[kTile];
  for (int r = 0; r < kTile; ++r) {
    rsum[r] = 0;
    rsc[r] = inv[r] = 0.f;
    if (r >= rows) continue;
    const uint16_t* x = reinterpret_cast<const uint16_t*>(row_of(p, t0 + r));
    // the largest |value| as the largest bf16 bit pattern without its sign (inf and NaN above all)
    __m512i m = _mm512_setzero_si512();
    for (int64_t j = 0; j < d; j += 32)
      m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_set1_epi16(0x7fff),
                                               _mm512_maskz_loadu_epi16(m32(d - j), x + j)));
    alignas(64) uint16_t lanes[32];
    _mm512_store_si512(lanes, m);
    uint16_t top = 0;
    for (int L = 0; L < 32; ++L) top = lanes[L] > top ? lanes[L] : top;
    if (top >= 0x7f80) return false;
    const float amax = bf16_to_float(top);
    if (amax > 0.f) {
      rsc[r] = amax / 127.f;
      inv[r] = 127.f / amax;
    }
  }
  pack_lanes16(p, t0, rows, P, 4, [&](int r, const char* row, int64_t j, int64_t n) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(row) + j;
    const __m512 s = _mm512_set1_ps(inv[r]);
    __m512i out = _mm512_setzero_si512(), sum = _mm512_setzero_si512();
    for (int u = 0; u < 4 && 16 * u < n; ++u) {
      const __m256i h = _mm256_maskz_loadu_epi16(m16(n - 16 * u), x + 16 * u);
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v, s));  // |c| <= 127: no clamp needed
      sum = _mm512_add_epi32(sum, c);
      out = _mm512_mask_broadcast_i32x4(out, __mmask16(0xFu << (4 * u)), _mm512_cvtepi32_epi8(c));
    }
    rsum[r] += _mm512_reduce_add_epi32(sum);
    return out;
  });
  return true;
}
#endif

void scan_packed(const Problem& p, int64_t r0, int64_t r1, TopK* tk, float* scratch, uint32_t* ran) {
  const int D = packed_depth(p);
  void* P = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
  for (int64_t t0 = r0; t0 < r1; t0 += kTile) {
    const int rows = int(imin(kTile, r1 - t0));
#ifdef TK_VNNI
    if (p.kind == kBF16 && p.wrange > 0) {  // wrange 0: a query is not finite (prepare_bf16_codes)
      // the quantised tile's row sums and factors follow its (d + 3) / 4 lanes x 64 rows (scratch_floats)
      uint32_t* W = static_cast<uint32_t*>(P);
      const int D4 = int((p.d + 3) / 4);
      int32_t* rsum = reinterpret_cast<int32_t*>(W + int64_t(D4) * kTile);
      float* rsc = reinterpret_cast<float*>(rsum + kTile);
      if (pack_tile_bf16q(p, t0, rows, W, rsum, rsc)) {
        *ran |= 1u << kkPackedBf16q;
        for_query_blocks(p.B, [&](auto qb, int64_t b) {
          pk_i8<decltype(qb)::value>(p, W, D4, rsum, rsc, b, t0, rows, tk);
        });
        continue;
      }
    }
#endif
    *ran |= 1u << kkPacked;
    pack_tile(p, t0, rows, P);
    for_query_blocks(p.B, [&](auto qb, int64_t b) { packed_block<decltype(qb)::value>(p, P, D, b, t0, rows, tk); });
  }
}

// ---------------------------------------------------------------------------- query-major kernels
// For mid-size batches: 16 queries per vector (queries transposed once per call), corpus
// elements broadcast straight from the rows (embedded {1to16} broadcasts), so no corpus
// transpose and no horizontal reduction. RB rows x G query groups = 24 accumulators.
// bf16 broadcasts a pair of codes into vdpbf16ps, int8 four codes into vpdpbusd.

template <int KIND> struct AccOf { using type = __m512; };
template <> struct AccOf<kI8> { using type = __m512i; };

template <int KIND, int RB, int G>
inline void qm_block(const Problem& p, int64_t g0, int64_t r0, TopK* tk) {
  constexpr int per = KIND == kBF16 ? 2 : KIND == kI8 ? 4 : 1;
  using V = typename AccOf<KIND>::type;
  V acc[RB][G];
  for (int i = 0; i < RB; ++i)
    for (int g = 0; g < G; ++g) {
      if constexpr (KIND == kI8) acc[i][g] = _mm512_setzero_si512();
      else acc[i][g] = _mm512_setzero_ps();
    }
  const char* rows[RB];
  for (int i = 0; i < RB; ++i) rows[i] = row_of(p, r0 + i);
  const uint32_t* qt = p.qt + g0 * 16;
  const int64_t Bp = p.Bp;
  const int64_t full = p.d / per;  // depth steps read whole 32-bit words from every row
  auto step = [&](int64_t j, const uint32_t* words) {
    V qv[G];
    for (int g = 0; g < G; ++g) {
      if constexpr (KIND == kF32) qv[g] = _mm512_loadu_ps(reinterpret_cast<const float*>(qt + j * Bp + g * 16));
      else if constexpr (KIND == kBF16) qv[g] = _mm512_castsi512_ps(_mm512_loadu_si512(qt + j * Bp + g * 16));
      else qv[g] = _mm512_loadu_si512(qt + j * Bp + g * 16);
    }
    for (int i = 0; i < RB; ++i) {
      if constexpr (KIND == kF32) {
        const __m512 c = _mm512_set1_ps(reinterpret_cast<const float*>(rows[i])[j]);
        for (int g = 0; g < G; ++g) acc[i][g] = _mm512_fmadd_ps(qv[g], c, acc[i][g]);
      } else {
        uint32_t w;
        if (words) w = words[i];
        else std::memcpy(&w, rows[i] + j * 4, 4);
        const __m512i c = _mm512_set1_epi32(int(w));
        for (int g = 0; g < G; ++g) {
#if defined(TK_BF16)
          if constexpr (KIND == kBF16)
            acc[i][g] = _mm512_dpbf16_ps(acc[i][g], (__m512bh)_mm512_castps_si512(qv[g]), (__m512bh)c);
#endif
#if defined(TK_VNNI)
          if constexpr (KIND == kI8) acc[i][g] = _mm512_dpbusd_epi32(acc[i][g], qv[g], c);
#endif
        }
      }
    }
  };
  for (int64_t j = 0; j < full; ++j) step(j, nullptr);
  if constexpr (per > 1) {
    if (full * per < p.d) {  // the last, partial word of each row: never read past the row
      uint32_t words[RB];
      const int64_t nb = (p.d - full * per) * p.esize;
      for (int i = 0; i < RB; ++i) {
        words[i] = 0;
        std::memcpy(&words[i], rows[i] + full * 4, size_t(nb));
      }
      step(full, words);
    }
  }
  // spill once (see pk_float), then threshold-test 16 queries per vector
  alignas(64) float sc[RB][G][16];
  for (int i = 0; i < RB; ++i)
    for (int g = 0; g < G; ++g) {
      if constexpr (KIND == kI8) {
        const int64_t r = r0 + i;
        __m512i dot = _mm512_sub_epi32(acc[i][g], _mm512_set1_epi32(128 * p.rowsum[r]));
        _mm512_store_ps(sc[i][g], _mm512_mul_ps(_mm512_cvtepi32_ps(dot),
                                                _mm512_mul_ps(_mm512_set1_ps(p.scale[r]),
                                                              _mm512_loadu_ps(p.qdeq + g0 * 16 + g * 16))));
      } else {
        _mm512_store_ps(sc[i][g], acc[i][g]);
      }
    }
  for (int g = 0; g < G; ++g) {
    const int64_t q0 = (g0 + g) * 16;
    const int nq = int(imin(16, p.B - q0));
    alignas(64) float thr[16];
    for (int L = 0; L < 16; ++L) thr[L] = L < nq ? tk[q0 + L].thr : kInf;
    const __m512 tv = _mm512_load_ps(thr);
    for (int i = 0; i < RB; ++i) {
      __mmask16 m = _mm512_cmp_ps_mask(_mm512_load_ps(sc[i][g]), tv, _CMP_GE_OQ) & m16(nq);
      while (m) {
        const int L = __builtin_ctz(m);
        m &= m - 1;
        tk_push(tk[q0 + L], sc[i][g][L], r0 + i);
      }
    }
  }
}

template <int KIND, int G>
void qm_rows(const Problem& p, int64_t g0, int64_t r0, int64_t r1, TopK* tk) {
  constexpr int RB = 24 / G;
  int64_t r = r0;
  for (; r + RB <= r1; r += RB) qm_block<KIND, RB, G>(p, g0, r, tk);
  for (; r < r1; ++r) qm_block<KIND, 1, G>(p, g0, r, tk);
}

template <int KIND>
void scan_qmajor_k(const Problem& p, int64_t r0, int64_t r1, TopK* tk) {
  const int64_t groups = p.Bp / 16;
  // Row tiles small enough to stay in L2 while every group of 64 queries passes over them.
  const int64_t tile = imax(24, (96 << 10) / imax(1, p.d * p.esize) / 24 * 24);
  for (int64_t t0 = r0; t0 < r1; t0 += tile) {
    const int64_t t1 = imin(r1, t0 + tile);
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
      switch (imin(4, groups - g0)) {
        case 4: qm_rows<KIND, 4>(p, g0, t0, t1, tk); break;
        case 3: qm_rows<KIND, 3>(p, g0, t0, t1, tk); break;
        case 2: qm_rows<KIND, 2>(p, g0, t0, t1, tk); break;
        default: qm_rows<KIND, 1>(p, g0, t0, t1, tk); break;
      }
    }
  }
}

void scan_qmajor(const Problem& p, int64_t r0, int64_t r1, TopK* tk) {
  switch (p.kind) {
#ifdef TK_BF16
    case kBF16: return scan_qmajor_k<kBF16>(p, r0, r1, tk);
#endif
#ifdef TK_VNNI
    case kI8: return scan_qmajor_k<kI8>(p, r0, r1, tk);
#endif
    default: return scan_qmajor_k<kF32>(p, r0, r1, tk);
  }
}
#endif  // TK_SIMD

#if defined(TK_PAIRS2)
// ---------------------------------------------------------------------------- AVX2 stream
// QB x RB accumulators of 8 lanes, S splits along d for one query: 8 FMA chains in flight
// (16 ymm registers: 8 accumulators, 4 row vectors, a query vector).

template <int KIND, int QB, int RB, int S>
inline void sk2_float(const Problem& p, int64_t b0, int64_t r0, float* out) {
  __m256 acc[S][QB][RB];
  for (int t = 0; t < S; ++t)
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) acc[t][b][i] = _mm256_setzero_ps();
  const char* rows[RB];
  for (int i = 0; i < RB; ++i) rows[i] = row_of(p, r0 + i);
  const float* q = p.qf + b0 * p.qs;
  const int64_t d = p.d;
  auto chunk = [&](int t, int64_t j, int64_t n) __attribute__((always_inline)) {
    __m256 rv[RB];
    for (int i = 0; i < RB; ++i) rv[i] = load8<KIND>(rows[i], j, n);
    for (int b = 0; b < QB; ++b) {
      const __m256 qv = _mm256_loadu_ps(q + b * p.qs + j);  // zero padded past d
      for (int i = 0; i < RB; ++i) acc[t][b][i] = _mm256_fmadd_ps(qv, rv[i], acc[t][b][i]);
    }
  };
  int64_t j = 0;
  for (; j + 8 * S <= d; j += 8 * S)
    for (int t = 0; t < S; ++t) chunk(t, j + 8 * t, 8);
  for (; j + 8 <= d; j += 8) chunk(0, j, 8);
  if (j < d) chunk(0, j, d - j);
  for (int t = 1; t < S; ++t)
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) acc[0][b][i] = _mm256_add_ps(acc[0][b][i], acc[t][b][i]);
  for (int b = 0; b < QB; ++b)
    for (int i = 0; i < RB; ++i) {
      float s = hsum8(acc[0][b][i]);
      if (KIND == kI8) s *= p.scale[r0 + i];
      out[b * RB + i] = s;
    }
}

// int8: 16 codes sign-extended to int16, vpmaddwd with the int16 query codes.
template <int QB, int RB, int S>
inline void sk2_i8(const Problem& p, int64_t b0, int64_t r0, float* out) {
  __m256i acc[S][QB][RB];
  for (int t = 0; t < S; ++t)
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) acc[t][b][i] = _mm256_setzero_si256();
  const int8_t* rows[RB];
  for (int i = 0; i < RB; ++i) rows[i] = reinterpret_cast<const int8_t*>(row_of(p, r0 + i));
  const int16_t* q = p.qw + b0 * p.qsw;
  const int64_t d = p.d;
  auto chunk = [&](int t, int64_t j, int64_t n) __attribute__((always_inline)) {
    __m256i rv[RB];
    for (int i = 0; i < RB; ++i) {
      __m128i c;
      if (n >= 16) {
        c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + j));
      } else {
        int8_t buf[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
        std::memcpy(buf, rows[i] + j, size_t(n));
        c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
      }
      rv[i] = _mm256_cvtepi8_epi16(c);
    }
    for (int b = 0; b < QB; ++b) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * p.qsw + j));  // zero padded
      for (int i = 0; i < RB; ++i) acc[t][b][i] = _mm256_add_epi32(acc[t][b][i], _mm256_madd_epi16(qv, rv[i]));
    }
  };
  int64_t j = 0;
  for (; j + 16 * S <= d; j += 16 * S)
    for (int t = 0; t < S; ++t) chunk(t, j + 16 * t, 16);
  for (; j + 16 <= d; j += 16) chunk(0, j, 16);
  if (j < d) chunk(0, j, d - j);
  for (int t = 1; t < S; ++t)
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) acc[0][b][i] = _mm256_add_epi32(acc[0][b][i], acc[t][b][i]);
  for (int b = 0; b < QB; ++b)
    for (int i = 0; i < RB; ++i)
      out[b * RB + i] = float(hsum8i(acc[0][b][i])) * p.scale[r0 + i] * p.qdeq[b0 + b];
}

template <int QB, int RB, int S>
inline void stream_block2(const Problem& p, int64_t b0, int64_t r0, float* out) {
  switch (p.kind) {
    case kF32: sk2_float<kF32, QB, RB, S>(p, b0, r0, out); break;
    case kF16: sk2_float<kF16, QB, RB, S>(p, b0, r0, out); break;
    case kBF16: sk2_float<kBF16, QB, RB, S>(p, b0, r0, out); break;
    default: sk2_i8<QB, RB, S>(p, b0, r0, out); break;
  }
}

template <int QB, int RB, int S>
void stream_rows2(const Problem& p, int64_t b0, int64_t r0, int64_t r1, TopK* tk) {
  float out[QB * RB];
  int64_t r = r0;
  for (; r + RB <= r1; r += RB) {
    stream_block2<QB, RB, S>(p, b0, r, out);
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) tk_push(tk[b0 + b], out[b * RB + i], r + i);
  }
  for (; r < r1; ++r) {
    stream_block2<QB, 1, S>(p, b0, r, out);
    for (int b = 0; b < QB; ++b) tk_push(tk[b0 + b], out[b], r);
  }
}

void scan_stream2(const Problem& p, int64_t r0, int64_t r1, TopK* tk) {
  // L1-sized row tiles, every query pair over one tile before the next (see scan_stream)
  const int64_t rowbytes = p.d * p.esize;
  const int64_t tile = imax(8, imin(256, (24 << 10) / imax(rowbytes, 1))) / 4 * 4;
  // The first query pair brings the tile in from memory one row at a time (int8: 2 rows), with
  // 4 split accumulators per query: 4 rows side by side ran at 0.5-0.6x the memory bandwidth
  // of a row-at-a-time scan on Zen 4. Later pairs find the tile in L1, where 4-row blocks reuse
  // each query load 4 times. Forced avx2, one thread, 200k x 384 fp32, ms before -> after: B=1
  // 24 -> 13, B=2 29 -> 14, B=8 43 -> 32 (int8 at d=768, B=1: 20 -> 9).
  const bool i8 = p.kind == kI8;
  for (int64_t t0 = r0; t0 < r1; t0 += tile) {
    const int64_t t1 = imin(r1, t0 + tile);
    int64_t b = 0;
    if (p.B >= 2) {
      if (i8) stream_rows2<2, 2, 2>(p, 0, t0, t1, tk);
      else stream_rows2<2, 1, 4>(p, 0, t0, t1, tk);
      b = 2;
    }
    for (; b + 2 <= p.B; b += 2) stream_rows2<2, 4, 1>(p, b, t0, t1, tk);
    if (b < p.B) {
      if (b == 0) stream_rows2<1, 1, 4>(p, b, t0, t1, tk);
      else stream_rows2<1, 4, 2>(p, b, t0, t1, tk);
    }
  }
}

// ---------------------------------------------------------------------------- AVX2 packed
// A 64-row tile converted to fp32 and stored as four 16-row panels, each depth-major
// ([panel][j][16]); a depth chunk of a panel stays in L1 while every block of 6 queries passes
// over it: 6 x 2 accumulators, 2 panel loads and 6 broadcasts per depth step. int8 has its own
// tile of int16 depth pairs (pk2_i8).

// Rows t0 .. t0+rows of the corpus as fp32 (int8 dequantised) in four 16-row panels, each
// depth-major ([panel][j][16]); rows past `rows` are zero.
void pack_tile2(const Problem& p, int64_t t0, int rows, float* P) {
  for (int r0 = 0; r0 < kTile; r0 += 8) {
    float* dst = P + (r0 / 16) * p.d * 16 + (r0 % 16);
    pack_rows8(p, t0, rows, r0, [&](int64_t j, __m256 v) { _mm256_storeu_ps(dst + j * 16, v); });
  }
}

// Depth chunk of the AVX2 packed kernels. A 16-row panel chunk (16 x 256 floats, 16 KB) and a
// 6-query chunk (6 KB) stay in L1 together, and every query's chunk (B x 1 KB) stays in L2,
// whatever d and B are; over the full depth, d = 768 and B = 256 spilled both (48 KB panels,
// 786 KB of queries per tile) and the kernel fell to 0.8x of an sgemm. Partial sums between
// chunks go through `part` ([B][64] floats, one tile's four panels side by side).
constexpr int64_t kDepth2 = 256;

template <int QB>
__attribute__((noinline)) void pk2(const Problem& p, const float* panel, int64_t j0, int64_t j1, float* part, bool last, int64_t b0,
         int64_t row0, int nvalid, TopK* tk) {
  // Every loop over the accumulators is fully unrolled and the selection reads them back from a
  // buffer: a runtime index into `acc` makes GCC keep all twelve on the stack inside the hot
  // loop (measured: each FMA paired with a store, 0.4x of the stream kernel).
  __m256 acc[QB][2];
#pragma GCC unroll 8
  for (int b = 0; b < QB; ++b) {
    acc[b][0] = j0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(part + (b0 + b) * kTile);
    acc[b][1] = j0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(part + (b0 + b) * kTile + 8);
  }
  const float* q = p.qf + b0 * p.qs;
  const int64_t qs = p.qs;
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 v0 = _mm256_loadu_ps(panel + j * 16), v1 = _mm256_loadu_ps(panel + j * 16 + 8);
#pragma GCC unroll 8
    for (int b = 0; b < QB; ++b) {
      const __m256 qv = _mm256_broadcast_ss(q + b * qs + j);
      acc[b][0] = _mm256_fmadd_ps(qv, v0, acc[b][0]);
      acc[b][1] = _mm256_fmadd_ps(qv, v1, acc[b][1]);
    }
  }
  alignas(32) float buf[QB][16];
  float* dst[QB];
#pragma GCC unroll 8
  for (int b = 0; b < QB; ++b) dst[b] = last ? buf[b] : part + (b0 + b) * kTile;
#pragma GCC unroll 8
  for (int b = 0; b < QB; ++b) {
    _mm256_storeu_ps(dst[b], acc[b][0]);
    _mm256_storeu_ps(dst[b] + 8, acc[b][1]);
  }
  if (!last) return;
  for (int b = 0; b < QB; ++b) {
    TopK& t = tk[b0 + b];
    const __m256 thr = _mm256_set1_ps(t.thr);
    unsigned m = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(buf[b]), thr, _CMP_GE_OQ))) |
                 unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(buf[b] + 8), thr, _CMP_GE_OQ))) << 8;
    m &= nvalid >= 16 ? 0xffffu : ((1u << nvalid) - 1);
    while (m) {
      const int L = __builtin_ctz(m);
      m &= m - 1;
      tk_push(t, buf[b][L], row0 + L);
    }
  }
}

// int8 packed: the tile's codes widened to int16 and stored as depth pairs, [panel][pair][16 rows]
// in 32-bit units (a pair of codes per unit), so vpmaddwd against a broadcast pair of int16
// query codes gives 8 rows' dot over two depths per instruction (16 multiply-adds, against 8 per
// fp32 FMA); products sum in int32 and cannot saturate (2 * 127 * 127 per step). Scores are the
// stream kernel's exactly: float(int dot) * row scale * query dequantisation.
// bf16 packed runs the same kernel on a tile quantised per row to int16 codes in [-R, R]
// (Problem::wrange, chosen with the query codes so that no int32 sum can overflow): an
// approximate first pass at twice the multiply-adds per instruction of the widened fp32 one,
// whose over-fetched candidates the driver re-scores exactly, as for AVX-512's vdpbf16ps.
constexpr int64_t kPairs2 = 256;  // depth pairs per chunk: a panel chunk is 16 KB, as for fp32

// Rows t0 .. t0+rows as int16 depth pairs in four 16-row panels; load16(row, j, n) gives 16
// int16 codes of a row from depth j (n of them real, the rest 0). Rows past `rows` are zero.
template <class Load16>
inline void pack_pairs(const Problem& p, int64_t t0, int rows, uint32_t* P, Load16 load16) {
  const int64_t d = p.d, D2 = (d + 1) / 2;
  for (int r0 = 0; r0 < kTile; r0 += 8) {
    uint32_t* dst = P + (r0 / 16) * D2 * 16 + (r0 % 16);
    const char* row[8];
    for (int i = 0; i < 8; ++i) row[i] = r0 + i < rows ? row_of(p, t0 + r0 + i) : nullptr;
    for (int64_t j = 0; j < d; j += 16) {
      const int64_t n = imin(16, d - j);
      __m256 v[8];
      for (int i = 0; i < 8; ++i)  // 8 pairs as 32-bit lanes
        v[i] = row[i] ? _mm256_castsi256_ps(load16(r0 + i, row[i], j, n)) : _mm256_setzero_ps();
      transpose8(v);
      const int64_t np = (n + 1) / 2;
      for (int64_t u = 0; u < np; ++u)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (j / 2 + u) * 16), _mm256_castps_si256(v[u]));
    }
  }
}

void pack_tile2_i8(const Problem& p, int64_t t0, int rows, uint32_t* P) {
  pack_pairs(p, t0, rows, P, [](int, const char* row, int64_t j, int64_t n) {
    const int8_t* r = reinterpret_cast<const int8_t*>(row) + j;
    if (n == 16) return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
    int8_t buf[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, r, size_t(n));
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(buf)));
  });
}

// A bf16 tile as int16 codes, each row scaled by R / its largest |value|; rsc[r] receives the
// row's dequantisation factor (0 for an all-zero or absent row). Returns false, packing
// nothing, when a row holds an inf or a NaN: the caller scans that tile widened to fp32.
bool pack_tile2_bf16(const Problem& p, int64_t t0, int rows, uint32_t* P, float* rsc) {
  const int64_t d = p.d;
  const float R = float(p.wrange);
  alignas(32) float inv[kTile];
  for (int r = 0; r < kTile; ++r) {
    rsc[r] = inv[r] = 0.f;
    if (r >= rows) continue;
    // the largest |value| as the largest bf16 bit pattern without its sign; inf and NaN
    // patterns are above every finite one
    const uint16_t* x = reinterpret_cast<const uint16_t*>(row_of(p, t0 + r));
    __m256i m = _mm256_setzero_si256();
    const __m256i abs = _mm256_set1_epi16(0x7fff);
    int64_t j = 0;
    for (; j + 16 <= d; j += 16)
      m = _mm256_max_epu16(m, _mm256_and_si256(abs, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j))));
    alignas(32) uint16_t lanes[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
    uint16_t top = 0;
    for (int L = 0; L < 16; ++L) top = lanes[L] > top ? lanes[L] : top;
    for (; j < d; ++j) top = uint16_t(x[j] & 0x7fff) > top ? uint16_t(x[j] & 0x7fff) : top;
    if (top >= 0x7f80) return false;
    const float amax = bf16_to_float(top);
    if (amax > 0.f) {
      rsc[r] = amax / R;
      inv[r] = R / amax;
    }
  }
  pack_pairs(p, t0, rows, P, [&](int r, const char* row, int64_t j, int64_t n) {
    const __m256 s = _mm256_set1_ps(inv[r]);
    const int64_t n1 = imin(8, n), n2 = imax(0, n - 8);
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(load8<kBF16>(row, j, n1), s));
    const __m256i hi = n2 ? _mm256_cvtps_epi32(_mm256_mul_ps(load8<kBF16>(row, j + 8, n2), s)) : _mm256_setzero_si256();
    // packs works per 128-bit lane ([lo 0-3, hi 0-3 | lo 4-7, hi 4-7]); the permute restores depth order
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
  });
  return true;
}

// noinline: inlined into the scan loop, GCC ran out of ymm registers (12 accumulators, 2 panel
// vectors, a broadcast and a product fill all 16) and spilled an accumulator every step (1.5x slower)
template <int QB>
__attribute__((noinline)) void pk2_i8(const Problem& p, const uint32_t* panel, const float* rsc, int64_t k0, int64_t k1,
            int32_t* part, bool last, int64_t b0, int64_t row0, int nvalid, TopK* tk) {
  // accumulators handled as in pk2: unrolled loops only, selection through a buffer
  __m256i acc[QB][2];
#pragma GCC unroll 8
  for (int b = 0; b < QB; ++b) {
    const __m256i* src = reinterpret_cast<const __m256i*>(part + (b0 + b) * kTile);
    acc[b][0] = k0 == 0 ? _mm256_setzero_si256() : _mm256_loadu_si256(src);
    acc[b][1] = k0 == 0 ? _mm256_setzero_si256() : _mm256_loadu_si256(src + 1);
  }
  const int16_t* q = p.qw + b0 * p.qsw;
  const int64_t qs = p.qsw;
  for (int64_t k = k0; k < k1; ++k) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * 16));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * 16 + 8));
#pragma GCC unroll 8
    for (int b = 0; b < QB; ++b) {
      int32_t pair;  // query codes 2k and 2k+1 (zero padded past d)
      std::memcpy(&pair, q + b * qs + 2 * k, 4);
      const __m256i qv = _mm256_set1_epi32(pair);
      acc[b][0] = _mm256_add_epi32(acc[b][0], _mm256_madd_epi16(v0, qv));
      acc[b][1] = _mm256_add_epi32(acc[b][1], _mm256_madd_epi16(v1, qv));
    }
  }
  alignas(32) int32_t buf[QB][16];
  int32_t* dst[QB];
#pragma GCC unroll 8
  for (int b = 0; b < QB; ++b) dst[b] = last ? buf[b] : part + (b0 + b) * kTile;
#pragma GCC unroll 8
  for (int b = 0; b < QB; ++b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst[b]), acc[b][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst[b] + 8), acc[b][1]);
  }
  if (!last) return;
  alignas(32) float sc[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  for (int L = 0; L < 16 && L < nvalid; ++L) sc[L] = rsc[L];  // the panel's rows' dequantisation
  for (int b = 0; b < QB; ++b) {
    TopK& t = tk[b0 + b];
    alignas(32) float s[16];
    for (int L = 0; L < 16; ++L) s[L] = float(buf[b][L]) * sc[L] * p.qdeq[b0 + b];  // as sk2_i8
    const __m256 thr = _mm256_set1_ps(t.thr);
    unsigned m = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(s), thr, _CMP_GE_OQ))) |
                 unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(s + 8), thr, _CMP_GE_OQ))) << 8;
    m &= nvalid >= 16 ? 0xffffu : ((1u << nvalid) - 1);
    while (m) {
      const int L = __builtin_ctz(m);
      m &= m - 1;
      tk_push(t, s[L], row0 + L);
    }
  }
}

// The loops of the AVX2 packed kernels over one tile: depth chunks of `chunk` units (floats or
// int16 pairs) out of `depth`, each 16-row panel, each query block; run(qb, panel, k0, k1,
// last chunk, first query) calls the micro-kernel.
template <class Run>
inline void tile_blocks(const Problem& p, int rows, int64_t depth, int64_t chunk, Run run) {
  for (int64_t k0 = 0; k0 < depth; k0 += chunk) {
    const int64_t k1 = imin(depth, k0 + chunk);
    for (int g = 0; g * 16 < rows; ++g)
      for_query_blocks(p.B, [&](auto qb, int64_t b) { run(qb, g, k0, k1, k1 == depth, b); });
  }
}

// One tile of int16 depth pairs (int8, or quantised bf16) against every query; rsc: its rows'
// dequantisation factors.
void pairs_tile(const Problem& p, const uint32_t* P, const float* rsc, int64_t t0, int rows, int32_t* part, TopK* tk) {
  const int64_t D2 = (p.d + 1) / 2;
  tile_blocks(p, rows, D2, kPairs2, [&](auto qb, int g, int64_t k0, int64_t k1, bool last, int64_t b) {
    pk2_i8<decltype(qb)::value>(p, P + g * D2 * 16, rsc + g * 16, k0, k1, part + g * 16, last, b, t0 + g * 16,
                                rows - g * 16, tk);
  });
}

// One tile widened to fp32 against every query.
void float_tile(const Problem& p, float* P, int64_t t0, int rows, float* part, TopK* tk) {
  pack_tile2(p, t0, rows, P);
  tile_blocks(p, rows, p.d, kDepth2, [&](auto qb, int g, int64_t j0, int64_t j1, bool last, int64_t b) {
    pk2<decltype(qb)::value>(p, P + g * p.d * 16, j0, j1, part + g * 16, last, b, t0 + g * 16, rows - g * 16, tk);
  });
}

void scan_packed2(const Problem& p, int64_t r0, int64_t r1, TopK* tk, float* P, uint32_t* ran) {
  // scratch (scratch_floats): the tile (64 x d floats, or 64 x ceil(d/2) pairs), then [B][64]
  // partial sums between depth chunks, then the tile's 64 row factors (bf16)
  float* part = P + kTile * p.d;
  float* rsc = part + kTile * p.B;
  uint32_t* W = reinterpret_cast<uint32_t*>(P);
  int32_t* ipart = reinterpret_cast<int32_t*>(part);
  for (int64_t t0 = r0; t0 < r1; t0 += kTile) {
    const int rows = int(imin(kTile, r1 - t0));
    if (p.kind == kI8) {
      *ran |= 1u << kkPacked2Pairs;
      pack_tile2_i8(p, t0, rows, W);
      pairs_tile(p, W, p.scale + t0, t0, rows, ipart, tk);
    } else if (p.kind == kBF16 && p.wrange > 0 && pack_tile2_bf16(p, t0, rows, W, rsc)) {
      *ran |= 1u << kkPacked2Pairs;
      pairs_tile(p, W, rsc, t0, rows, ipart, tk);
    } else {
      *ran |= 1u << kkPacked2;
      float_tile(p, P, t0, rows, part, tk);
    }
  }
}
#endif  // TK_PAIRS2

#if defined(TK_AMX)
// ---------------------------------------------------------------------------- AMX tile kernels
// C[16 rows x 16 queries] += A[16 rows x 64 bytes of depth] * B[depth x 16 queries]:
//  * A is the corpus read in place, row-major (tileloadd takes the row stride), so the corpus
//    is never packed: bf16 storage 32 depth elements per tile row, int8 64, and fp32 rows
//    converted to bf16 16 rows at a time (the bf16 first pass of the exact fp32 search);
//  * B is the queries in VNNI layout ([depth pair or quad][Bp queries], 32-bit words), made
//    once per call by the dispatcher (Problem::qt): for 16 queries, a 64-byte slice of 16
//    depth rows;
//  * int8 multiplies signed codes by signed codes (tdpbssd: exact int32, no +128 offset and
//    row-sum correction), scaled as pk_i8 does;
//  * the running top-k is fed from each 16 x 16 result: one vector compare per corpus row
//    against the 16 queries' thresholds, pushes are rare.
// Blocking: 2 row groups x 2 query blocks = 4 accumulator tiles (tmm0-3), 2 A tiles (tmm4-5),
// 2 B tiles (tmm6-7): 4 tile multiplies per 4 tile loads. A group whose last 64-byte chunk
// runs past d, or with fewer than 16 rows, is read from a zero-padded copy (reading past a row
// could touch NaN bf16 bit patterns, which 0 * NaN would spread, or unmapped memory).

bool amx_supported(int kind) { return kind == kF32 || kind == kBF16 || kind == kI8; }

struct alignas(64) TileCfg {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void amx_configure() {
  TileCfg cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Bytes of one A-tile row of depth: bf16 (also fp32 converted) 2 per element, int8 1.
inline int amx_esize(int kind) { return kind == kI8 ? 1 : 2; }
inline int64_t amx_rowbytes(const Problem& p) { return (p.d * amx_esize(p.kind) + 63) / 64 * 64; }

// Where one 16-row group's A tiles come from: chunk c < nfull at base + c * 64 (row stride
// `stride`), the last chunk (if any) from `tail` (16 rows x 64 bytes, zero padded).
struct AmxSrc {
  const char* base;
  int64_t stride;
  int64_t nfull;
  const char* tail;
  int rows;  // corpus rows in the group (1..16)
};

// fp32 rows -> bf16 (round to nearest even, vcvtne2ps2bf16), zero padded to `rb` bytes; returns
// the row's sum of squares (fp32), for the error bound of the fp32 pass.
inline float amx_row_f32(const float* x, int64_t d, int64_t rb, uint16_t* out) {
  __m512 ss = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < d; j += 32) {
    const __m512 a = _mm512_maskz_loadu_ps(m16(d - j), x + j);
    const __m512 b = _mm512_maskz_loadu_ps(m16(d - j - 16 > 0 ? d - j - 16 : 0), x + j + 16);
    ss = _mm512_fmadd_ps(a, a, _mm512_fmadd_ps(b, b, ss));
    _mm512_store_si512(out + j, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
  for (; j * 2 < rb; j += 32) _mm512_store_si512(out + j, _mm512_setzero_si512());
  return _mm512_reduce_add_ps(ss);
}

// Prepare one group starting at corpus row g0 with `rows` rows; `buf` holds 16 rows of
// amx_rowbytes, `tail` 16 x 64 bytes (both 64-byte aligned). Returns the group's source.
AmxSrc amx_group(const Problem& p, int64_t g0, int rows, char* buf, char* tail, float* sumsq) {
  const int64_t rb = amx_rowbytes(p);
  const int64_t nchunks = rb / 64;
  const int64_t bytes = p.d * amx_esize(p.kind);
  if (p.kind == kF32) {
    float mx = *sumsq;
    for (int r = 0; r < 16; ++r) {
      uint16_t* out = reinterpret_cast<uint16_t*>(buf + r * rb);
      if (r < rows) {
        const float s = amx_row_f32(reinterpret_cast<const float*>(row_of(p, g0 + r)), p.d, rb, out);
        // NaN rows never score (their exact score is NaN too); inf stays inf and forces the exact rescan
        mx = s > mx ? s : mx;
      } else {
        std::memset(out, 0, size_t(rb));
      }
    }
    *sumsq = mx;
    return AmxSrc{buf, rb, nchunks, nullptr, rows};
  }
  if (rows < 16) {  // a short group: whole rows into the padded buffer
    for (int r = 0; r < 16; ++r) {
      char* out = buf + r * rb;
      std::memset(out, 0, size_t(rb));
      if (r < rows) std::memcpy(out, row_of(p, g0 + r), size_t(bytes));
    }
    return AmxSrc{buf, rb, nchunks, nullptr, rows};
  }
  const int64_t nfull = bytes / 64;
  if (nfull < nchunks) {
    for (int r = 0; r < 16; ++r) {
      char* out = tail + r * 64;
      _mm512_store_si512(out, _mm512_maskz_loadu_epi8(m64(bytes - nfull * 64), row_of(p, g0 + r) + nfull * 64));
    }
  }
  return AmxSrc{row_of(p, g0), p.rs * p.esize, nfull, tail, rows};
}

inline const char* amx_a(const AmxSrc& s, int64_t c, int64_t& stride) {
  if (c < s.nfull) {
    stride = s.stride;
    return s.base + c * 64;
  }
  stride = 64;
  return s.tail;
}

// NG row groups x NQ query blocks from query b0; C results into out[g * 2 + q][16][16].
// Depth chunks [c0, c1) of NG row groups x NQ query blocks from query b0, accumulated onto
// `out` ([g * 2 + q][16][16]) unless `fresh`. pf: the next 32 rows to prefetch (the first
// query block of a group only), else nullptr.
template <int NG, int NQ, bool I8>
inline void amx_block(const Problem& p, const AmxSrc* src, int64_t b0, int64_t c0, int64_t c1, bool fresh, void* out,
                      const char* pf, int pf_rows) {
  char* o = static_cast<char*>(out);
  if (fresh) {
    _tile_zero(0);
    if constexpr (NQ > 1) _tile_zero(1);
    if constexpr (NG > 1) {
      _tile_zero(2);
      if constexpr (NQ > 1) _tile_zero(3);
    }
  } else {
    _tile_loadd(0, o, 64);
    if constexpr (NQ > 1) _tile_loadd(1, o + 1024, 64);
    if constexpr (NG > 1) {
      _tile_loadd(2, o + 2048, 64);
      if constexpr (NQ > 1) _tile_loadd(3, o + 3072, 64);
    }
  }
  const int64_t qstride = p.Bp * 4;
  const char* qb = reinterpret_cast<const char*>(p.qt + b0);
  for (int64_t c = c0; c < c1; ++c) {
    int64_t s0, s1 = 0;
    const char* a0 = amx_a(src[0], c, s0);
    const char* a1 = NG > 1 ? amx_a(src[1], c, s1) : nullptr;
    const char* bq = qb + c * 16 * qstride;
    if (pf)  // the next group's chunk c, one line per row
      for (int r = 0; r < pf_rows; ++r) _mm_prefetch(pf + r * p.rs * p.esize + c * 64, _MM_HINT_T0);
    _tile_loadd(4, a0, s0);
    _tile_loadd(6, bq, qstride);
    if constexpr (NQ > 1) _tile_loadd(7, bq + 64, qstride);
    if constexpr (NG > 1) _tile_loadd(5, a1, s1);
    if constexpr (I8) {
      _tile_dpbssd(0, 4, 6);
      if constexpr (NQ > 1) _tile_dpbssd(1, 4, 7);
      if constexpr (NG > 1) {
        _tile_dpbssd(2, 5, 6);
        if constexpr (NQ > 1) _tile_dpbssd(3, 5, 7);
      }
    } else {
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NQ > 1) _tile_dpbf16ps(1, 4, 7);
      if constexpr (NG > 1) {
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (NQ > 1) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, o, 64);
  if constexpr (NQ > 1) _tile_stored(1, o + 1024, 64);
  if constexpr (NG > 1) {
    _tile_stored(2, o + 2048, 64);
    if constexpr (NQ > 1) _tile_stored(3, o + 3072, 64);
  }
}

// Feed one 16 x 16 result (corpus rows g0.., queries b0..) into the running top-k lists.
inline void amx_push(const Problem& p, const void* C, int64_t g0, int rows, int64_t b0, TopK* tk) {
  const int nq = int(imin(16, p.B - b0));
  const __mmask16 qvalid = m16(nq);
  alignas(64) float thr[16];
  for (int n = 0; n < 16; ++n) thr[n] = n < nq ? tk[b0 + n].thr : kInf;
  __m512 tv = _mm512_load_ps(thr);
  __m512 qd = _mm512_setzero_ps();
  if (p.kind == kI8) qd = _mm512_maskz_loadu_ps(qvalid, p.qdeq + b0);
  for (int m = 0; m < rows; ++m) {
    __m512 v;
    if (p.kind == kI8) {  // as pk_i8: float(dot) * (row factor * query factor)
      const __m512i dot = _mm512_load_si512(static_cast<const int32_t*>(C) + m * 16);
      v = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(p.scale[g0 + m]), qd));
    } else {
      v = _mm512_load_ps(static_cast<const float*>(C) + m * 16);
    }
    __mmask16 hit = _mm512_cmp_ps_mask(v, tv, _CMP_GE_OQ) & qvalid;
    if (!hit) continue;
    alignas(64) float s[16];
    _mm512_store_ps(s, v);
    while (hit) {
      const int n = __builtin_ctz(hit);
      hit &= hit - 1;
      tk_push(tk[b0 + n], s[n], g0 + m);
      thr[n] = tk[b0 + n].thr;
    }
    tv = _mm512_load_ps(thr);
  }
}

// Scratch layout (64-byte aligned): two groups' padded rows, two tails, four C tiles per pair of
// query blocks.
int64_t amx_scratch_bytes(const Problem& p) {
  return 2 * 16 * amx_rowbytes(p) + 2 * 1024 + (p.B + 31) / 32 * 4 * 1024 + 64;
}

// Depth chunks per pass over the query blocks: 8 (256 bf16 or 512 int8 elements) keep a row
// pair's slice (32 rows x 512 bytes, 16 KB) in L1 while every query block passes over it, the
// accumulators going through memory between slices; over the whole depth (d = 768 bf16: 48 KB
// a row pair) both operands streamed from L2 at B = 256.
constexpr int64_t kAmxDepthBlock = 8;

void scan_amx(const Problem& p, int64_t r0, int64_t r1, TopK* tk, float* scratch, float* sumsq) {
  char* S = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
  const int64_t rb = amx_rowbytes(p), nchunks = rb / 64;
  char* buf[2] = {S, S + 16 * rb};
  char* tail[2] = {S + 32 * rb, S + 32 * rb + 1024};
  char* C = S + 32 * rb + 2048;
  const bool i8 = p.kind == kI8;
  amx_configure();
  for (int64_t t0 = r0; t0 < r1; t0 += 32) {
    const int rows0 = int(imin(16, r1 - t0));
    const int rows1 = int(imin(16, imax(0, r1 - t0 - 16)));
    AmxSrc src[2];
    src[0] = amx_group(p, t0, rows0, buf[0], tail[0], sumsq);
    const int ng = rows1 > 0 ? 2 : 1;
    if (ng == 2) src[1] = amx_group(p, t0 + 16, rows1, buf[1], tail[1], sumsq);
    // Prefetch the next 32 rows while the first query block works on these: the tile loads read
    // 16 rows side by side, which the hardware prefetchers follow poorly. fp32 groups are
    // converted row by row (sequential reads), so they need none.
    const int pf_rows = int(imin(32, imax(0, r1 - t0 - 32)));
    const char* pf = pf_rows > 0 && p.kind != kF32 ? row_of(p, t0 + 32) : nullptr;
    for (int64_t c0 = 0; c0 < nchunks; c0 += kAmxDepthBlock) {
      const int64_t c1 = imin(nchunks, c0 + kAmxDepthBlock);
      const bool fresh = c0 == 0, last = c1 == nchunks;
      for (int64_t b0 = 0; b0 < p.B; b0 += 32) {
        const int nq = p.B - b0 > 16 ? 2 : 1;
        const char* f = b0 == 0 ? pf : nullptr;
        char* Cb = C + (b0 / 32) * 4096;
        if (ng == 2 && nq == 2) i8 ? amx_block<2, 2, true>(p, src, b0, c0, c1, fresh, Cb, f, pf_rows) : amx_block<2, 2, false>(p, src, b0, c0, c1, fresh, Cb, f, pf_rows);
        else if (ng == 2) i8 ? amx_block<2, 1, true>(p, src, b0, c0, c1, fresh, Cb, f, pf_rows) : amx_block<2, 1, false>(p, src, b0, c0, c1, fresh, Cb, f, pf_rows);
        else if (nq == 2) i8 ? amx_block<1, 2, true>(p, src, b0, c0, c1, fresh, Cb, f, pf_rows) : amx_block<1, 2, false>(p, src, b0, c0, c1, fresh, Cb, f, pf_rows);
        else i8 ? amx_block<1, 1, true>(p, src, b0, c0, c1, fresh, Cb, f, pf_rows) : amx_block<1, 1, false>(p, src, b0, c0, c1, fresh, Cb, f, pf_rows);
        if (!last) continue;
        for (int g = 0; g < ng; ++g)
          for (int q = 0; q < nq; ++q) amx_push(p, Cb + (g * 2 + q) * 1024, t0 + 16 * g, src[g].rows, b0 + 16 * q, tk);
      }
    }
  }
  _tile_release();
}
#endif  // TK_AMX

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
