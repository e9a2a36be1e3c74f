// Fused inner-product top-k: blocked scoring with a running per-query top-k, so the [B, N]
// score matrix is never written. Storage: fp32, fp16, bf16, int8 (per-vector scale).
//
// Layout of the work:
//  * threads split the corpus into row blocks (OpenMP, dynamic); each thread keeps its own
//    top-`fetch` per query and the lists are merged at the end, so no locks in the hot loop;
//  * small batches (bandwidth-bound) use "stream" micro-kernels that read rows in place and
//    dot along d with QB x RB accumulators (several independent FMA chains per row);
//  * mid/large batches (compute-bound) use one of two GEMM-style kernels with no horizontal
//    reductions, 16 scores per vector and a vector threshold test: "query-major" (queries
//    transposed once per call, 16 per vector, corpus elements broadcast from the rows: fp32,
//    bf16) or "packed" (a 64-row tile transposed once and reused by every block of 6 queries:
//    fp16, int8). The batch sizes at which kernels switch were measured (see Paths);
//  * bf16 uses AVX512_BF16 vdpbf16ps (query rounded to bf16), int8 uses AVX512_VNNI vpdpbusd
//    (query quantised to int8 and offset to unsigned, the offset removed with a per-row code
//    sum). Both are approximate first passes: they over-fetch candidates and re-score them
//    exactly with the fp32 query before the final selection.
// Every ISA-specific piece has a portable scalar fallback.
#include "registry.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef RAGFAST_OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TK_SIMD 1
#endif
#if defined(TK_SIMD) && defined(__AVX512BF16__)
#define TK_BF16 1
#endif
#if defined(TK_SIMD) && defined(__AVX512VNNI__)
#define TK_VNNI 1
#endif

namespace py = pybind11;

namespace {

enum Kind : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3 };
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kTile = 64;  // rows per packed tile: 4 vectors of 16 scores

struct Hit {
  float s;
  int64_t id;
};

inline bool better(float s1, int64_t i1, float s2, int64_t i2) { return s1 > s2 || (s1 == s2 && i1 < i2); }
inline bool hit_better(const Hit& a, const Hit& b) { return better(a.s, a.id, b.s, b.id); }

// Running top-`cap` of one query inside one thread, kept sorted best-first. `thr` is the score a
// candidate must reach: the floor (min_score or -inf) until the list is full, then its worst.
struct TopK {
  Hit* h = nullptr;
  int n = 0, cap = 0;
  float thr = kNegInf;
  const int64_t* ex = nullptr;  // sorted, unique excluded ids
  int nex = 0;

  inline void push(float s, int64_t id) {
    if (!(s >= thr)) return;  // the common case; also rejects NaN
    insert(s, id);
  }
  void insert(float s, int64_t id) {
    if (s == kNegInf) return;  // -inf marks an empty slot, never a hit
    if (n == cap && !better(s, id, h[n - 1].s, h[n - 1].id)) return;
    if (nex && std::binary_search(ex, ex + nex, id)) return;
    int j = n < cap ? n++ : cap - 1;
    while (j > 0 && better(s, id, h[j - 1].s, h[j - 1].id)) {
      h[j] = h[j - 1];
      --j;
    }
    h[j] = Hit{s, id};
    if (n == cap) thr = h[cap - 1].s;
  }
};

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
inline uint16_t float_to_bf16(float f) {  // round to nearest even; inputs are finite
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// Exact fp32 dot of a query with one stored row (dequantised by `scale` for int8).
float dot_exact(const float* q, const void* row, int kind, int d, float scale) {
#ifdef TK_SIMD
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

// ---------------------------------------------------------------------------- problem

struct Problem {
  int64_t B = 0, N = 0, d = 0;
  int kind = kF32;
  const float* q = nullptr;  // [B, d] contiguous fp32
  const char* base = nullptr;  // corpus storage
  int64_t rs = 0;              // row stride in elements of the storage type
  int esize = 4;
  const float* scale = nullptr;    // int8
  const int32_t* rowsum = nullptr;  // int8
  // prepared queries
  int64_t qs = 0;                // stride of qf (floats), padded to 16
  std::vector<float> qf;         // fp32 copy, zero padded (fp32 / fp16 kernels)
  int64_t qs16 = 0;              // stride of qh in uint16, padded to 32
  std::vector<uint16_t> qh;      // bf16 queries
  int64_t qs8 = 0;               // stride of qb in bytes, padded to 64
  std::vector<uint8_t> qb;       // int8 queries + 128
  std::vector<float> qdeq;       // int8 query dequantisation factor (padded to Bp for qmajor)
  // query-major layout (qmajor kernels): depth-major, 16 queries per vector
  bool qmajor = false;
  int64_t Bp = 0;                // B rounded up to 16
  std::vector<uint32_t> qt;      // [depth][Bp]: fp32 bits, a bf16 pair, or four unsigned int8 codes

  const char* row(int64_t r) const { return base + (r * rs) * esize; }
};

void prepare_queries(Problem& p) {
  const int64_t B = p.B, d = p.d;
  p.qs = (d + 15) / 16 * 16;
  p.qf.assign(size_t(B * p.qs), 0.f);
  for (int64_t b = 0; b < B; ++b) std::memcpy(&p.qf[b * p.qs], p.q + b * d, size_t(d) * 4);
  if (p.kind == kBF16) {
    p.qs16 = (d + 31) / 32 * 32;
    p.qh.assign(size_t(B * p.qs16), 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < d; ++j) p.qh[b * p.qs16 + j] = float_to_bf16(p.q[b * d + j]);
  } else if (p.kind == kI8) {
    p.qs8 = (d + 63) / 64 * 64;
    p.qb.assign(size_t(B * p.qs8), 128);
    p.qdeq.assign(size_t(B), 0.f);
    for (int64_t b = 0; b < B; ++b) {
      float amax = 0.f;
      for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(p.q[b * d + j]));
      float qscale = amax > 0 ? 127.f / amax : 1.f;
      p.qdeq[b] = 1.f / qscale;
      for (int64_t j = 0; j < d; ++j) {
        int v = int(std::lrint(p.q[b * d + j] * qscale));
        v = std::min(127, std::max(-127, v));
        p.qb[b * p.qs8 + j] = uint8_t(v + 128);
      }
    }
  }
  if (p.qmajor) {
    p.Bp = (B + 15) / 16 * 16;
    const int per = p.kind == kBF16 ? 2 : p.kind == kI8 ? 4 : 1;
    const int64_t D = (d + per - 1) / per;
    // padding lanes and depth are 0: for int8 that is an unsigned 0 (not the +128 offset), so
    // padded depth contributes nothing and the rowsum correction stays exact.
    p.qt.assign(size_t(D * p.Bp), 0u);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < d; ++j) {
        uint32_t v;
        if (p.kind == kBF16) {
          v = uint32_t(p.qh[b * p.qs16 + j]) << (16 * (j % 2));
        } else if (p.kind == kI8) {
          v = uint32_t(p.qb[b * p.qs8 + j]) << (8 * (j % 4));
        } else {
          std::memcpy(&v, &p.q[b * d + j], 4);
        }
        p.qt[(j / per) * p.Bp + b] |= v;
      }
    if (p.kind == kI8) p.qdeq.resize(size_t(p.Bp), 0.f);
  }
}

// ---------------------------------------------------------------------------- scalar scan

void scan_scalar(const Problem& p, int64_t r0, int64_t r1, TopK* tk) {
  std::vector<float> deq(size_t(p.d));
  for (int64_t r = r0; r < r1; ++r) {
    const char* row = p.row(r);
    for (int64_t j = 0; j < p.d; ++j) {
      switch (p.kind) {
        case kF32: deq[j] = reinterpret_cast<const float*>(row)[j]; break;
        case kF16: deq[j] = half_to_float(reinterpret_cast<const uint16_t*>(row)[j]); break;
        case kBF16: deq[j] = bf16_to_float(reinterpret_cast<const uint16_t*>(row)[j]); break;
        default: deq[j] = float(reinterpret_cast<const int8_t*>(row)[j]) * p.scale[r]; break;
      }
    }
    for (int64_t b = 0; b < p.B; ++b) {
      const float* q = p.q + b * p.d;
      float s = 0.f;
      for (int64_t j = 0; j < p.d; ++j) s += q[j] * deq[j];
      tk[b].push(s, r);
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
  for (int i = 0; i < RB; ++i) rows[i] = p.row(r0 + i);
  const float* q = p.qf.data() + b0 * p.qs;
  const int64_t d = p.d;
  auto chunk = [&](int t, int64_t j, __mmask16 m, bool full) {
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
}

#ifdef TK_BF16
template <int QB, int RB, int S>
inline void sk_bf16(const Problem& p, int64_t b0, int64_t r0, float* out) {
  __m512 acc[S][QB][RB];
  for (int t = 0; t < S; ++t)
    for (int b = 0; b < QB; ++b)
      for (int i = 0; i < RB; ++i) acc[t][b][i] = _mm512_setzero_ps();
  const uint16_t* rows[RB];
  for (int i = 0; i < RB; ++i) rows[i] = reinterpret_cast<const uint16_t*>(p.row(r0 + i));
  const uint16_t* q = p.qh.data() + b0 * p.qs16;
  const int64_t d = p.d;
  auto chunk = [&](int t, int64_t j, bool full) {
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
  for (int i = 0; i < RB; ++i) rows[i] = reinterpret_cast<const int8_t*>(p.row(r0 + i));
  const uint8_t* q = p.qb.data() + b0 * p.qs8;
  const int64_t d = p.d;
  auto chunk = [&](int t, int64_t j, bool full) {
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
    __m512 qd = _mm512_permutexvar_ps(qi, _mm512_maskz_loadu_ps(__mmask16((1u << QB) - 1), p.qdeq.data() + b0));
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
#endif
    default: break;
  }
}

template <int QB>
void stream_rows(const Problem& p, int64_t b0, int64_t r0, int64_t r1, TopK* tk) {
  // 4 rows; QB x 4 x S >= 12 accumulators (independent FMA chains).
  constexpr int RB = 4;
  constexpr int S = QB == 1 ? 4 : QB == 2 ? 2 : 1;
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
        tk[b0 + L / RB].push(out[L], r + L % RB);
      }
    } else {
      for (int b = 0; b < QB; ++b)
        for (int i = 0; i < RB; ++i) tk[b0 + b].push(out[b * RB + i], r + i);
    }
  }
  for (; r < r1; ++r) {
    stream_block<QB, 1, S>(p, b0, r, out);
    for (int b = 0; b < QB; ++b) tk[b0 + b].push(out[b], r);
  }
}

void scan_stream(const Problem& p, int64_t r0, int64_t r1, TopK* tk) {
  // Rows in L1-sized tiles, all query blocks over one tile before the next: the corpus is read
  // from memory once whatever B is.
  const int64_t rowbytes = p.d * p.esize;
  // a multiple of the 4-row micro-block, so only the range's last rows take the 1-row kernel
  const int64_t tile = std::max<int64_t>(8, std::min<int64_t>(256, (24 << 10) / std::max<int64_t>(rowbytes, 1))) / 4 * 4;
  for (int64_t t0 = r0; t0 < r1; t0 += tile) {
    const int64_t t1 = std::min(r1, t0 + tile);
    int64_t b = 0;
    for (; b + 4 <= p.B; b += 4) stream_rows<4>(p, b, t0, t1, tk);
    switch (p.B - b) {
      case 3: stream_rows<3>(p, b, t0, t1, tk); break;
      case 2: stream_rows<2>(p, b, t0, t1, tk); break;
      case 1: stream_rows<1>(p, b, t0, t1, tk); break;
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

void pack_tile(const Problem& p, int64_t t0, int rows, void* P) {
  const int64_t d = p.d;
  const int D = packed_depth(p);
  if (packed_lanes(p)) {
    uint32_t* out = static_cast<uint32_t*>(P);
    const int per = p.kind == kBF16 ? 2 : 4;  // elements per 32-bit lane
    const int es = p.esize;
    for (int r = 0; r < kTile; ++r) {
      if (r >= rows) {
        for (int j = 0; j < D; ++j) out[j * kTile + r] = 0;
        continue;
      }
      const char* row = p.row(t0 + r);
      const int full = int(d / per);
      for (int j = 0; j < full; ++j) {
        uint32_t v;
        std::memcpy(&v, row + int64_t(j) * 4, 4);
        out[j * kTile + r] = v;
      }
      if (full < D) {
        uint32_t v = 0;
        std::memcpy(&v, row + int64_t(full) * 4, size_t((d - int64_t(full) * per) * es));
        out[full * kTile + r] = v;
      }
    }
    return;
  }
  float* out = static_cast<float*>(P);
  for (int r = 0; r < kTile; ++r) {
    if (r >= rows) {
      for (int64_t j = 0; j < d; ++j) out[j * kTile + r] = 0.f;
      continue;
    }
    const char* row = p.row(t0 + r);
    if (p.kind == kF32) {
      const float* x = reinterpret_cast<const float*>(row);
      for (int64_t j = 0; j < d; ++j) out[j * kTile + r] = x[j];
    } else {
      // 16 at a time through the vector converters, then scattered by depth
      alignas(64) float buf[16];
      for (int64_t j = 0; j < d; j += 16) {
        __mmask16 m = m16(d - j);
        __m512 v = p.kind == kF16 ? load_f<kF16>(row, j, m, false)
                  : p.kind == kBF16 ? load_f<kBF16>(row, j, m, false)
                                    : _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                        _mm_maskz_loadu_epi8(m, reinterpret_cast<const int8_t*>(row) + j))),
                                                    _mm512_set1_ps(p.scale[t0 + r]));
        _mm512_store_ps(buf, v);
        const int64_t n = std::min<int64_t>(16, d - j);
        for (int64_t u = 0; u < n; ++u) out[(j + u) * kTile + r] = buf[u];
      }
    }
  }
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
    t.push(buf[i], row0 + i);
  }
}

template <int QB>
void pk_float(const Problem& p, const float* P, int64_t b0, int64_t t0, int rows, TopK* tk) {
  __m512 acc[QB][4];
  for (int b = 0; b < QB; ++b)
    for (int g = 0; g < 4; ++g) acc[b][g] = _mm512_setzero_ps();
  const float* q = p.qf.data() + b0 * p.qs;
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
  const uint32_t* q = reinterpret_cast<const uint32_t*>(p.qh.data() + b0 * p.qs16);
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
template <int QB>
void pk_i8(const Problem& p, const uint32_t* P, int D, int64_t b0, int64_t t0, int rows, TopK* tk) {
  __m512i acc[QB][4];
  for (int b = 0; b < QB; ++b)
    for (int g = 0; g < 4; ++g) acc[b][g] = _mm512_setzero_si512();
  const uint32_t* q = reinterpret_cast<const uint32_t*>(p.qb.data() + b0 * p.qs8);
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
    __m512i rsum = _mm512_maskz_loadu_epi32(valid, p.rowsum + r0);
    __m512 rscale = _mm512_maskz_loadu_ps(valid, p.scale + r0);
    __m512i off = _mm512_slli_epi32(rsum, 7);  // 128 * rowsum
    for (int b = 0; b < QB; ++b) {
      __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(buf[b][g]), off)),
                                _mm512_mul_ps(rscale, _mm512_set1_ps(p.qdeq[b0 + b])));
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
  if (p.kind == kI8) return pk_i8<QB>(p, static_cast<const uint32_t*>(P), D, b0, t0, rows, tk);
#endif
  pk_float<QB>(p, static_cast<const float*>(P), b0, t0, rows, tk);
}

void scan_packed(const Problem& p, int64_t r0, int64_t r1, TopK* tk, std::vector<float>& scratch) {
  const int D = packed_depth(p);
  scratch.resize(size_t(D) * kTile + 16);
  void* P = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  for (int64_t t0 = r0; t0 < r1; t0 += kTile) {
    const int rows = int(std::min<int64_t>(kTile, r1 - t0));
    pack_tile(p, t0, rows, P);
    int64_t b = 0;
    for (; b + 6 <= p.B; b += 6) packed_block<6>(p, P, D, b, t0, rows, tk);
    switch (p.B - b) {
      case 5: packed_block<5>(p, P, D, b, t0, rows, tk); break;
      case 4: packed_block<4>(p, P, D, b, t0, rows, tk); break;
      case 3: packed_block<3>(p, P, D, b, t0, rows, tk); break;
      case 2: packed_block<2>(p, P, D, b, t0, rows, tk); break;
      case 1: packed_block<1>(p, P, D, b, t0, rows, tk); break;
      default: break;
    }
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
  for (int i = 0; i < RB; ++i) rows[i] = p.row(r0 + i);
  const uint32_t* qt = p.qt.data() + g0 * 16;
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
                                                              _mm512_loadu_ps(p.qdeq.data() + g0 * 16 + g * 16))));
      } else {
        _mm512_store_ps(sc[i][g], acc[i][g]);
      }
    }
  for (int g = 0; g < G; ++g) {
    const int64_t q0 = (g0 + g) * 16;
    const int nq = int(std::min<int64_t>(16, p.B - q0));
    alignas(64) float thr[16];
    for (int L = 0; L < 16; ++L) thr[L] = L < nq ? tk[q0 + L].thr : std::numeric_limits<float>::infinity();
    const __m512 tv = _mm512_load_ps(thr);
    for (int i = 0; i < RB; ++i) {
      __mmask16 m = _mm512_cmp_ps_mask(_mm512_load_ps(sc[i][g]), tv, _CMP_GE_OQ) & m16(nq);
      while (m) {
        const int L = __builtin_ctz(m);
        m &= m - 1;
        tk[q0 + L].push(sc[i][g][L], r0 + i);
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
  const int64_t tile = std::max<int64_t>(24, (96 << 10) / std::max<int64_t>(1, p.d * p.esize) / 24 * 24);
  for (int64_t t0 = r0; t0 < r1; t0 += tile) {
    const int64_t t1 = std::min(r1, t0 + tile);
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
      switch (std::min<int64_t>(4, groups - g0)) {
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

// Kernel choice by batch size: stream below `qmajor_min`, query-major from there, packed from
// `packed_min` (fp16 has no query-major kernel: a broadcast fp16 element needs a conversion
// per FMA). Settable through _C.topk_ip_paths so tests can force every path on small inputs.
struct Paths {
  // Single-thread medians at N=50k, d=384 (ms, stream/query-major/packed), from which these
  // come: fp32 B=32 23.7/16.1/29.2, B=256 146/97/107; fp16 B=64 36.4/-/38.6, B=256 130/-/105;
  // bf16 B=32 11.2/10.2/16.2; int8 B=16 4.0/4.8/4.5, B=32 7.1/9.9/6.4, B=256 38/63/31.
  int64_t qmajor_min[4] = {24, 1 << 30, 32, 1 << 30};
  int64_t packed_min[4] = {1 << 30, 128, 1 << 30, 24};
};
Paths g_paths;

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

enum Path { kStream = 0, kQmajor = 1, kPacked = 2, kScalar = 3 };

int choose_path(int kind, int64_t B) {
#ifdef TK_SIMD
#ifndef TK_VNNI
  if (kind == kI8) return B >= g_paths.packed_min[kF32] ? kPacked : kScalar;  // packed dequantises to fp32
#endif
  if (B >= g_paths.packed_min[kind]) return kPacked;
  if (B >= g_paths.qmajor_min[kind] && qmajor_supported(kind)) return kQmajor;
  return kStream;
#else
  (void)kind;
  (void)B;
  return kScalar;
#endif
}

void scan_range(const Problem& p, int path, int64_t r0, int64_t r1, TopK* tk, std::vector<float>& scratch) {
#ifdef TK_SIMD
  switch (path) {
    case kPacked: return scan_packed(p, r0, r1, tk, scratch);
    case kQmajor: return scan_qmajor(p, r0, r1, tk);
    case kStream: return scan_stream(p, r0, r1, tk);
    default: break;
  }
#endif
  (void)path;
  (void)scratch;
  scan_scalar(p, r0, r1, tk);
}

// ---------------------------------------------------------------------------- driver

struct Args {
  Problem p;
  int64_t k = 0, fetch = 0;
  float floor = kNegInf;
  bool approximate = false;  // first pass is approximate: re-score the candidates
  const char* rbase = nullptr;  // re-score storage (may be the corpus itself)
  int rkind = kF32;
  int64_t rrs = 0;
  int resize = 4;
  const int64_t* ex = nullptr;
  int64_t E = 0;
  float* out_s = nullptr;
  int64_t* out_i = nullptr;
  int threads = 0;
};

void run(Args& a) {
  Problem& p = a.p;
  const int64_t B = p.B, N = p.N;
  const int path = choose_path(p.kind, B);
  p.qmajor = path == kQmajor;
  prepare_queries(p);

  // Exclusion lists: sorted and unique per query, ids outside [0, N) dropped.
  std::vector<int64_t> exbuf;
  std::vector<int64_t> exoff(size_t(B + 1), 0);
  if (a.E > 0) {
    exbuf.reserve(size_t(B * a.E));
    for (int64_t b = 0; b < B; ++b) {
      const size_t s0 = exbuf.size();
      for (int64_t e = 0; e < a.E; ++e) {
        int64_t id = a.ex[b * a.E + e];
        if (id >= 0 && id < N) exbuf.push_back(id);
      }
      std::sort(exbuf.begin() + s0, exbuf.end());
      exbuf.erase(std::unique(exbuf.begin() + s0, exbuf.end()), exbuf.end());
      exoff[b + 1] = int64_t(exbuf.size());
    }
  }

  int T = 1;
#ifdef RAGFAST_OPENMP
  T = a.threads > 0 ? a.threads : omp_get_max_threads();
#endif
  // Below ~4M multiply-adds the fork/join and the merge cost more than a second core saves.
  if (double(B) * double(N) * double(p.d) < 4e6) T = 1;
  int64_t blk = (N + 8 * T - 1) / (8 * T);  // ~8 blocks per thread for dynamic balance
  blk = std::max<int64_t>(kTile, std::min<int64_t>(1 << 14, (blk + kTile - 1) / kTile * kTile));
  const int64_t nblk = (N + blk - 1) / blk;
  T = int(std::max<int64_t>(1, std::min<int64_t>(T, nblk)));

  const int64_t cap = a.fetch;
  std::vector<Hit> store(size_t(T) * B * cap);
  std::vector<TopK> tks(size_t(T) * B);
  for (int t = 0; t < T; ++t)
    for (int64_t b = 0; b < B; ++b) {
      TopK& tk = tks[size_t(t) * B + b];
      tk.h = &store[(size_t(t) * B + b) * cap];
      tk.cap = int(cap);
      tk.thr = a.approximate ? kNegInf : a.floor;
      tk.ex = exbuf.data() + exoff[b];
      tk.nex = int(exoff[b + 1] - exoff[b]);
    }

#ifdef RAGFAST_OPENMP
#pragma omp parallel num_threads(T)
#endif
  {
    int t = 0;
#ifdef RAGFAST_OPENMP
    t = omp_get_thread_num();
#endif
    std::vector<float> scratch;
    TopK* tk = &tks[size_t(t) * B];
#ifdef RAGFAST_OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < nblk; ++i) scan_range(p, path, i * blk, std::min(N, (i + 1) * blk), tk, scratch);
  }

  // Merge the per-thread lists, re-score approximate candidates, write k results per query.
#ifdef RAGFAST_OPENMP
#pragma omp parallel for schedule(static) num_threads(T) if (B > 1 && T > 1)
#endif
  for (int64_t b = 0; b < B; ++b) {
    std::vector<Hit> c;
    c.reserve(size_t(T * cap));
    for (int t = 0; t < T; ++t) {
      const TopK& tk = tks[size_t(t) * B + b];
      c.insert(c.end(), tk.h, tk.h + tk.n);
    }
    if (a.approximate) {
      const float* q = p.q + b * p.d;
      std::vector<Hit> r;
      r.reserve(c.size());
      for (const Hit& h : c) {
        const char* row = a.rbase + (h.id * a.rrs) * a.resize;
        float s = dot_exact(q, row, a.rkind, int(p.d), a.rkind == kI8 ? p.scale[h.id] : 1.f);
        if (s >= a.floor && s != kNegInf) r.push_back(Hit{s, h.id});  // NaN fails the test
      }
      c.swap(r);
    }
    const size_t n = std::min<size_t>(c.size(), size_t(a.k));
    std::partial_sort(c.begin(), c.begin() + n, c.end(), hit_better);
    float* os = a.out_s + b * a.k;
    int64_t* oi = a.out_i + b * a.k;
    for (size_t i = 0; i < n; ++i) {
      os[i] = c[i].s;
      oi[i] = c[i].id;
    }
    for (int64_t i = int64_t(n); i < a.k; ++i) {
      os[i] = kNegInf;
      oi[i] = -1;
    }
  }
}

// ---------------------------------------------------------------------------- binding

int storage_size(int kind) { return kind == kF32 ? 4 : kind == kI8 ? 1 : 2; }

void check_2d(const py::array& a, const char* what, int itemsize) {
  if (a.ndim() != 2) throw std::invalid_argument(std::string(what) + " must be 2-D");
  if (a.itemsize() != itemsize)
    throw std::invalid_argument(std::string(what) + ": expected " + std::to_string(itemsize) + "-byte elements");
  if (a.shape(1) > 1 && a.strides(1) != itemsize)
    throw std::invalid_argument(std::string(what) + " rows must be contiguous (unit stride along d)");
  if (a.strides(0) % itemsize != 0 || a.strides(0) < 0)
    throw std::invalid_argument(std::string(what) + ": row stride must be a non-negative multiple of the element size");
}

void topk_ip_binding(py::array queries, py::array corpus, int kind, py::object scale, py::object rowsum,
                     py::object rescore, int rkind, int64_t k, int64_t fetch, double min_score, py::array exclude,
                     py::array out_scores, py::array out_ids, int threads) {
  if (kind < kF32 || kind > kI8) throw std::invalid_argument("topk_ip: unknown storage kind");
  if (!py::isinstance<py::array_t<float>>(queries) || queries.ndim() != 2 ||
      !(queries.flags() & py::array::c_style))
    throw std::invalid_argument("topk_ip: queries must be a C-contiguous float32 [B, d] array");
  check_2d(corpus, "corpus", storage_size(kind));
  Args a;
  Problem& p = a.p;
  p.B = queries.shape(0);
  p.d = queries.shape(1);
  p.N = corpus.shape(0);
  p.kind = kind;
  p.esize = storage_size(kind);
  if (corpus.shape(1) != p.d) throw std::invalid_argument("topk_ip: dimension mismatch");
  if (p.N <= 0) throw std::invalid_argument("topk_ip: empty corpus");
  if (k <= 0 || k > p.N) throw std::invalid_argument("topk_ip: need 1 <= k <= N");
  // int8: 255 * 127 * d must fit the int32 VNNI accumulators
  if (kind == kI8 && p.d > 65000) throw std::invalid_argument("topk_ip: int8 storage supports d <= 65000");
  p.q = static_cast<const float*>(queries.data());
  p.base = static_cast<const char*>(corpus.data());
  p.rs = corpus.strides(0) / p.esize;
  py::array_t<float, py::array::c_style> sc;
  py::array_t<int32_t, py::array::c_style> rsum;
  if (kind == kI8) {
    if (scale.is_none() || rowsum.is_none()) throw std::invalid_argument("topk_ip: int8 storage needs scale and rowsum");
    sc = py::array_t<float, py::array::c_style>::ensure(scale);
    rsum = py::array_t<int32_t, py::array::c_style>::ensure(rowsum);
    if (!sc || !rsum || sc.size() != p.N || rsum.size() != p.N)
      throw std::invalid_argument("topk_ip: scale / rowsum must be float32 / int32 arrays of length N");
    p.scale = sc.data();
    p.rowsum = rsum.data();
  }
  a.k = k;
  a.fetch = std::max<int64_t>(k, std::min<int64_t>(fetch, p.N));
  a.floor = float(min_score);
  a.approximate = kind == kBF16 || kind == kI8;
  if (!a.approximate) a.fetch = k;
  py::array rarr;
  if (a.approximate) {
    if (!rescore.is_none()) {
      if (rkind < kF32 || rkind > kBF16) throw std::invalid_argument("topk_ip: re-score copy must be fp32/fp16/bf16");
      rarr = py::reinterpret_borrow<py::array>(rescore);
      check_2d(rarr, "rescore", storage_size(rkind));
      if (rarr.shape(0) != p.N || rarr.shape(1) != p.d) throw std::invalid_argument("topk_ip: rescore must be [N, d]");
      a.rbase = static_cast<const char*>(rarr.data());
      a.rkind = rkind;
      a.resize = storage_size(rkind);
      a.rrs = rarr.strides(0) / a.resize;
    } else {
      a.rbase = p.base;
      a.rkind = kind;
      a.resize = p.esize;
      a.rrs = p.rs;
    }
  }
  if (exclude.ndim() != 2 || exclude.itemsize() != 8 || exclude.shape(0) != p.B ||
      !(exclude.flags() & py::array::c_style))
    throw std::invalid_argument("topk_ip: exclude must be a C-contiguous int64 [B, E] array");
  a.E = exclude.shape(1);
  a.ex = static_cast<const int64_t*>(exclude.data());
  for (py::array* o : {&out_scores, &out_ids}) {
    if (o->ndim() != 2 || o->shape(0) != p.B || o->shape(1) != k || !(o->flags() & py::array::c_style) ||
        !o->writeable())
      throw std::invalid_argument("topk_ip: outputs must be writable C-contiguous [B, k] arrays");
  }
  if (out_scores.itemsize() != 4 || out_ids.itemsize() != 8)
    throw std::invalid_argument("topk_ip: outputs must be float32 scores and int64 ids");
  a.out_s = static_cast<float*>(out_scores.mutable_data());
  a.out_i = static_cast<int64_t*>(out_ids.mutable_data());
  a.threads = threads;
  py::gil_scoped_release release;
  run(a);
}

}  // namespace

py::dict topk_ip_paths(py::dict set) {
  for (auto item : set) {
    const std::string key = py::str(item.first);
    auto v = item.second.cast<std::vector<int64_t>>();
    if (v.size() != 4) throw std::invalid_argument("topk_ip_paths: each value is 4 batch sizes (fp32, fp16, bf16, int8)");
    int64_t* dst = key == "qmajor_min" ? g_paths.qmajor_min : key == "packed_min" ? g_paths.packed_min : nullptr;
    if (!dst) throw std::invalid_argument("topk_ip_paths: keys are 'qmajor_min' and 'packed_min'");
    for (int i = 0; i < 4; ++i) dst[i] = std::max<int64_t>(1, v[size_t(i)]);
  }
  py::dict out;
  out["qmajor_min"] = std::vector<int64_t>(g_paths.qmajor_min, g_paths.qmajor_min + 4);
  out["packed_min"] = std::vector<int64_t>(g_paths.packed_min, g_paths.packed_min + 4);
  py::dict chosen;
  for (int kind = 0; kind < 4; ++kind) {
    py::list l;
    for (int64_t B : {1, 4, 16, 64, 256}) l.append(choose_path(kind, B));
    chosen[py::int_(kind)] = l;
  }
  out["path_at_1_4_16_64_256"] = chosen;  // 0 stream, 1 query-major, 2 packed, 3 scalar
  return out;
}

RAGFAST_REGISTER(topk_ip, [](py::module_& m) {
  m.def("topk_ip_paths", &topk_ip_paths, py::arg("set") = py::dict(),
        "Get (and with `set`, change) the batch sizes at which topk_ip switches kernels, per storage kind "
        "(fp32, fp16, bf16, int8). For tests and tuning.");
  m.def("topk_ip", &topk_ip_binding, py::arg("queries"), py::arg("corpus"), py::arg("kind"), py::arg("scale"),
        py::arg("rowsum"), py::arg("rescore"), py::arg("rescore_kind"), py::arg("k"), py::arg("fetch"),
        py::arg("min_score"), py::arg("exclude"), py::arg("out_scores"), py::arg("out_ids"), py::arg("threads") = 0,
        "Fused inner-product top-k over fp32/fp16/bf16/int8 storage (kind 0/1/2/3); writes out_scores/out_ids.\n"
        "bf16/int8 over-fetch `fetch` candidates and re-score them with the fp32 query against `rescore`\n"
        "(or the storage itself). Use ragfast.ops.topk_ip, which validates and allocates.");
});
