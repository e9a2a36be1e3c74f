// Fused inner-product top-k: blocked scoring with a running per-query top-k, so the [B, N]
// score matrix is never written. Storage: fp32, fp16, bf16, int8 (per-vector scale).
//
// This file is the dispatcher: argument checks, query preparation, the thread split, the merge
// of per-thread lists and the exact re-scoring of approximate candidates. The scanning kernels
// are compiled once per ISA level (csrc/isa/topk_ip_<level>.cpp including
// csrc/topk_ip_kernels.h, each with its own target flags) and the level is chosen at runtime
// (csrc/isa.cpp: the best the CPU runs, or RAGFAST_ISA). This file is compiled for the
// baseline target, so it runs anywhere the module imports.
//
// Layout of the work:
//  * threads split the corpus into row blocks (OpenMP, dynamic); each thread keeps its own
//    top-`fetch` per query and the lists are merged at the end, so no locks in the hot loop;
//  * small batches (bandwidth-bound) use "stream" micro-kernels that read rows in place and
//    dot along d with QB x RB accumulators (several independent FMA chains per row);
//  * mid/large batches (compute-bound) use GEMM-style kernels with no horizontal reductions:
//    "query-major" (AVX-512: queries transposed once per call, 16 per vector, corpus elements
//    broadcast from the rows) or "packed" (a 64-row tile transposed once and reused by every
//    block of queries). The batch sizes at which kernels switch are per level (Paths);
//  * bf16 on AVX512_BF16 (vdpbf16ps, query rounded to bf16) and int8 (VNNI vpdpbusd with the
//    query offset to unsigned; AVX2 vpmaddwd on int16) are approximate first passes: they
//    over-fetch candidates and re-score them exactly with the fp32 query before the final
//    selection.
#include "registry.h"
#include "isa.h"
#include "topk_ip_common.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef RAGFAST_OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

namespace {

using namespace ragfast::topk_ip_common;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline bool hit_better(const Hit& a, const Hit& b) { return a.s > b.s || (a.s == b.s && a.id < b.id); }

inline uint16_t float_to_bf16(float f) {  // round to nearest even; inputs are finite
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// The kernels of each level; nullptr where the level is not compiled into this build.
const Kernels* level_kernels(int level) {
  switch (level) {
#define RAGFAST_TOPK_IP_CASE_(e, n) \
  case ragfast::isa::e: return &kernels_##n;
    RAGFAST_ISA_COMPILED(RAGFAST_TOPK_IP_CASE_)
#undef RAGFAST_TOPK_IP_CASE_
    default: return nullptr;
  }
}

// Kernel switch points per level, settable through _C.topk_ip_paths (tests force every path).
// Single-thread medians behind the AVX-512 defaults, at N=50k, d=384 (ms, stream/query-major/
// packed): fp32 B=32 23.7/16.1/29.2, B=256 146/97/107; fp16 B=64 36.4/-/38.6, B=256 130/-/105;
// bf16 B=32 11.2/10.2/16.2; int8 B=16 4.0/4.8/4.5, B=32 7.1/9.9/6.4, B=256 38/63/31.
Paths g_paths[ragfast::isa::kNumLevels];
bool g_paths_init = false;

Paths& level_paths(int level) {
  if (!g_paths_init) {  // only called with the GIL held (bindings), so no race
    for (int l = 0; l < ragfast::isa::kNumLevels; ++l)
      if (const Kernels* k = level_kernels(l)) g_paths[l] = k->defaults;
    g_paths_init = true;
  }
  return g_paths[level];
}

// Prepared query copies; the Problem points into them.
struct Prepared {
  std::vector<float> qf;
  std::vector<uint16_t> qh;
  std::vector<uint8_t> qb;
  std::vector<int16_t> qw;
  std::vector<float> qdeq;
  std::vector<float> qdeq8;
  std::vector<uint32_t> qt;
};

// bf16 queries as int16 codes for the AVX2 packed pass, which the plain AVX-512 level runs too
// (pk2_i8 over a tile quantised per row):
// codes in [-R, R] with 2 * ceil(d / 2) * R * R <= 2^30, so int32 sums of products cannot
// overflow. At d = 768, R = 1182: a code step is 1/1182 of the query's largest |value|, finer
// than bf16 rounding of a typical element (1/256 of its own value), and the driver re-scores
// the over-fetched candidates exactly. A query that is not finite leaves wrange 0 (the kernel
// then scans bf16 widened to fp32, exactly).
void prepare_bf16_codes(Problem& p, Prepared& w) {
  const int64_t B = p.B, d = p.d;
  const double pairs = double((d + 1) / 2);
  p.wrange = int32_t(std::min(32767.0, std::floor(std::sqrt(double(1 << 30) / (2.0 * pairs)))));
  p.qsw = (d + 31) / 32 * 32;
  w.qw.assign(size_t(B * p.qsw), 0);
  w.qdeq.assign(size_t(B), 0.f);
  for (int64_t b = 0; b < B; ++b) {
    float amax = 0.f;
    bool finite = true;
    for (int64_t j = 0; j < d; ++j) {
      finite = finite && std::isfinite(p.q[b * d + j]);
      amax = std::max(amax, std::fabs(p.q[b * d + j]));
    }
    if (!finite) {
      p.wrange = 0;
      return;
    }
    if (amax == 0.f) continue;  // codes and factor 0: every score 0, as exactly
    const float to_code = float(p.wrange) / amax;
    w.qdeq[b] = amax / float(p.wrange);
    for (int64_t j = 0; j < d; ++j) w.qw[b * p.qsw + j] = int16_t(std::lrint(p.q[b * d + j] * to_code));
  }
}

// int8 query codes in [-127, 127] against each query's largest |value|: qb (+128, VNNI's
// unsigned x signed operands), with `widen` also qw (the codes as int16, AVX2 vpmaddwd), and the
// dequantisation factor per query in `deq`.
void quantize_queries_i8(Problem& p, Prepared& w, std::vector<float>& deq, bool widen) {
  const int64_t B = p.B, d = p.d;
  p.qs8 = (d + 63) / 64 * 64;
  w.qb.assign(size_t(B * p.qs8), 128);
  if (widen) {
    p.qsw = (d + 31) / 32 * 32;
    w.qw.assign(size_t(B * p.qsw), 0);
  }
  deq.assign(size_t(B), 0.f);
  for (int64_t b = 0; b < B; ++b) {
    float amax = 0.f;
    for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(p.q[b * d + j]));
    float qscale = amax > 0 ? 127.f / amax : 1.f;
    deq[b] = 1.f / qscale;
    for (int64_t j = 0; j < d; ++j) {
      int v = int(std::lrint(p.q[b * d + j] * qscale));
      v = std::min(127, std::max(-127, v));
      w.qb[b * p.qs8 + j] = uint8_t(v + 128);
      if (widen) w.qw[b * p.qsw + j] = int16_t(v);
    }
  }
}

// The AMX B operand (scan_amx): 32-bit words, bf16 pairs (fp32 and bf16 storage; round to
// nearest even) or four signed int8 codes (int8 storage), the depth padded to whole tiles (16
// words per 64-byte chunk of a corpus row) and the queries to 16, packed tile by tile:
// [query block of 16][chunk][16 depth words][16 queries], so that each B tile is 1 KB in one
// piece and a query block's tiles follow each other in depth order. Against a [depth][Bp]
// layout (a tile's 16 rows Bp * 4 bytes apart) this ran bf16 13-22% faster at B = 64-256,
// d = 768 (200,000 rows, in-process round-robin, Intel Xeon with AMX, load 6): the hardware
// prefetchers follow one sequential stream per query block.
void prepare_amx(Problem& p, Prepared& w) {
  const int64_t B = p.B, d = p.d;
  const int per = p.kind == kI8 ? 4 : 2;
  const int64_t nchunks = (d * (p.kind == kI8 ? 1 : 2) + 63) / 64;
  p.Bp = (B + 15) / 16 * 16;
  w.qt.assign(size_t(nchunks * 16 * p.Bp), 0u);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < d; ++j) {
      const uint32_t v = per == 2 ? uint32_t(float_to_bf16(p.q[b * d + j])) << (16 * (j % 2))
                                  : uint32_t(uint8_t(int8_t(int(w.qb[b * p.qs8 + j]) - 128))) << (8 * (j % 4));
      const int64_t word = j / per;  // chunk word / 16, row word % 16 of that chunk's tile
      w.qt[(((b / 16) * nchunks + word / 16) * 16 + word % 16) * 16 + b % 16] |= v;
    }
}

void prepare_queries(Problem& p, Prepared& w, int qmajor_per, int path) {
  const int64_t B = p.B, d = p.d;
  p.qs = (d + 15) / 16 * 16;
  w.qf.assign(size_t(B * p.qs), 0.f);
  for (int64_t b = 0; b < B; ++b) std::memcpy(&w.qf[b * p.qs], p.q + b * d, size_t(d) * 4);
  if (p.kind == kBF16) {
    p.qs16 = (d + 31) / 32 * 32;
    w.qh.assign(size_t(B * p.qs16), 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < d; ++j) w.qh[b * p.qs16 + j] = float_to_bf16(p.q[b * d + j]);
    prepare_bf16_codes(p, w);
    quantize_queries_i8(p, w, w.qdeq8, false);  // the AVX-512 VNNI packed pass
  } else if (p.kind == kI8) {
    quantize_queries_i8(p, w, w.qdeq, true);
  }
  if (path == kAmx) {
    prepare_amx(p, w);
  } else if (p.qmajor) {
    p.Bp = (B + 15) / 16 * 16;
    const int per = qmajor_per;
    const int64_t D = (d + per - 1) / per;
    // padding lanes and depth are 0: for int8 that is an unsigned 0 (not the +128 offset), so
    // padded depth contributes nothing and the rowsum correction stays exact.
    w.qt.assign(size_t(D * p.Bp), 0u);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < d; ++j) {
        uint32_t v;
        if (per == 2) {
          v = uint32_t(w.qh[b * p.qs16 + j]) << (16 * (j % 2));
        } else if (per == 4) {
          v = uint32_t(w.qb[b * p.qs8 + j]) << (8 * (j % 4));
        } else {
          std::memcpy(&v, &p.q[b * d + j], 4);
        }
        w.qt[(j / per) * p.Bp + b] |= v;
      }
    if (p.kind == kI8) w.qdeq.resize(size_t(p.Bp), 0.f);
  }
  p.qf = w.qf.data();
  p.qh = w.qh.data();
  p.qb = w.qb.data();
  p.qw = w.qw.data();
  p.qdeq = w.qdeq.data();
  p.qdeq8 = (p.kind == kI8 ? w.qdeq : w.qdeq8).data();
  p.qt = w.qt.data();
}

// ---------------------------------------------------------------------------- driver

struct Args {
  Problem p{};
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
  int level = 0;  // ISA level and its switch points, fixed with the GIL held
  Paths paths{};
};

// What served one call (_C.topk_ip_last): tests assert the kernel their name promises.
struct Served {
  int level = -1, path = -1, kind = -1;
  uint32_t ran = 0;         // 1 << KernelBit per kernel that scanned rows
  int64_t B = 0;
  int64_t rescanned = 0;    // fp32 / fp16 through AMX: queries whose bf16 band check failed (exact rescan)
};

// The bf16 first pass of fp32 storage on AMX keeps every row that could be in the exact top k.
// Per query q and row x, with u = 2^-8 (bf16's unit roundoff, round to nearest even) and
// u32 = 2^-24 (fp32's):
//  * rounding: bf16(q_i) = q_i (1 + a_i), bf16(x_i) = x_i (1 + b_i), |a_i|, |b_i| <= u, so each
//    product (exact in fp32: 8 x 8 significand bits) is off by at most (2u + u^2) |q_i x_i|;
//  * accumulation: tdpbf16ps adds the products into an fp32 sum, at most d roundings, each of
//    relative size <= u32: at most gamma_d * sum |bf16(q_i) bf16(x_i)|, gamma_d = d u32 / (1 -
//    d u32), and that sum is <= (1 + u)^2 sum |q_i x_i|;
//  * sum |q_i x_i| <= ||q|| ||x|| (Cauchy-Schwarz);
//  * AMX treats bf16 denormals as 0 and flushes fp32 denormals: each of the d steps loses at
//    most 2^-126 (|other operand| + 1), a term tau = d 2^-126 ((1 + u)(||q|| + M) + 2).
// So |approx - exact| <= e = (2u + u^2 + gamma_d (1 + u)^2) ||q|| M + tau, M = max ||x|| (the
// largest row norm of the scan, computed in fp32 from the same rows and inflated by (1 +
// gamma_d) for its own rounding). If A_k is the k-th best approximate score, every row of the
// exact top k has approx >= exact_k - e >= A_k - 2e (k rows have approx >= A_k, so exact >= A_k
// - e). A list that dropped rows (full) dropped only rows scoring <= its worst kept W, so when
// W < A_k - 2e the candidates hold the exact top k, and the exact fp32 re-score selects it;
// otherwise (near ties wider than the list, inf or NaN norms) the query is rescanned exactly.
// The argument needs every finite-scoring row's approximate score finite (an inf or NaN one is
// never kept); that holds while ||q|| M stays far from fp32's range, so beyond 1e30 the margin
// is +inf and the query is rescanned.
double amx_f32_margin(const float* q, int64_t d, double max_sumsq) {
  const double u = std::ldexp(1.0, -8), u32 = std::ldexp(1.0, -24);
  const double gamma = double(d) * u32 / (1.0 - double(d) * u32);
  double qq = 0;
  for (int64_t j = 0; j < d; ++j) qq += double(q[j]) * double(q[j]);
  const double qn = std::sqrt(qq), M = std::sqrt(max_sumsq) * (1.0 + gamma);
  if (!(qn * M < 1e30)) return std::numeric_limits<double>::infinity();  // also NaN
  const double e = (2 * u + u * u + gamma * (1 + u) * (1 + u)) * qn * M +
                   double(d) * std::ldexp(1.0, -126) * ((1 + u) * (qn + M) + 2);
  return 2 * e;
}

Served run(Args& a) {
  Problem& p = a.p;
  const int64_t B = p.B, N = p.N;
  const Kernels& K = *level_kernels(a.level);
  const int path = K.choose_path(p.kind, B, a.paths);
  p.qmajor = path == kQmajor;
  Prepared prep;
  prepare_queries(p, prep, K.qmajor_per(p.kind), path);
  // fp32 on AMX: an approximate bf16 pass (re-scored exactly against the stored rows, checked by
  // amx_f32_margin). The list holds the band of near ties of typical data: random unit vectors,
  // 200k x 768, k = 10, have ~60 rows within 2e of the 10th (2e ~ 0.016, scores' sd 0.036).
  // fp16 takes the same route (no fp16 tile multiply on this level): its rows are rounded to
  // bf16 as fp32 rows are, so the same bound holds, and the re-score reads the fp16 rows.
  const bool exact_amx = path == kAmx && (p.kind == kF32 || p.kind == kF16);
  if (exact_amx) {
    a.approximate = true;
    a.fetch = std::min(N, std::max<int64_t>(4 * a.k, a.k + 128));
    a.rbase = p.base;
    a.rkind = p.kind;
    a.resize = p.esize;
    a.rrs = p.rs;
  }
  if (a.approximate) a.fetch = std::min(N, a.fetch * K.fetch_mult(p.kind, path));
  Served served;
  served.level = a.level;
  served.path = path;
  served.kind = p.kind;
  served.B = B;

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
  std::vector<uint32_t> ran(size_t(T), 0u);
  std::vector<float> sumsq(size_t(T), 0.f);
  std::vector<char> redo(size_t(B), 0);
  std::vector<Hit> store(size_t(T) * B * cap);
  std::vector<TopK> tks(size_t(T) * B);
  for (int t = 0; t < T; ++t)
    for (int64_t b = 0; b < B; ++b) {
      TopK& tk = tks[size_t(t) * B + b];
      tk.h = &store[(size_t(t) * B + b) * cap];
      tk.n = 0;
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
    std::vector<float> scratch(size_t(K.scratch_floats(p, path)));
    TopK* tk = &tks[size_t(t) * B];
#ifdef RAGFAST_OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < nblk; ++i)
      K.scan(p, path, i * blk, std::min(N, (i + 1) * blk), tk, scratch.data(), &ran[size_t(t)], &sumsq[size_t(t)]);
  }
  for (uint32_t r : ran) served.ran |= r;
  double max_sumsq = 0;
  for (float s : sumsq) max_sumsq = std::max(max_sumsq, double(s));

  // Merge the per-thread lists, re-score approximate candidates, write k results per query.
#ifdef RAGFAST_OPENMP
#pragma omp parallel for schedule(static) num_threads(T) if (B > 1 && T > 1)
#endif
  for (int64_t b = 0; b < B; ++b) {
    std::vector<Hit> c;
    c.reserve(size_t(T * cap));
    float worst = kNegInf;  // the best score a full list may have dropped
    for (int t = 0; t < T; ++t) {
      const TopK& tk = tks[size_t(t) * B + b];
      c.insert(c.end(), tk.h, tk.h + tk.n);
      if (tk.n == tk.cap && tk.n > 0) worst = std::max(worst, tk.h[tk.n - 1].s);
    }
    if (exact_amx) {  // see amx_f32_margin
      const double margin = amx_f32_margin(p.q + b * p.d, p.d, max_sumsq);
      bool complete = margin < std::numeric_limits<double>::infinity();
      if (complete && worst != kNegInf) {  // a list dropped rows: were they all outside the band?
        complete = false;
        if (int64_t(c.size()) >= a.k) {
          std::nth_element(c.begin(), c.begin() + (a.k - 1), c.end(), hit_better);
          complete = double(worst) < double(c[size_t(a.k - 1)].s) - margin;
        }
      }
      if (!complete) redo[size_t(b)] = 1;
    }
    if (a.approximate) {
      const float* q = p.q + b * p.d;
      std::vector<Hit> r;
      r.reserve(c.size());
      for (const Hit& h : c) {
        const char* row = a.rbase + (h.id * a.rrs) * a.resize;
        float s = K.dot_exact(q, row, a.rkind, int(p.d), a.rkind == kI8 ? p.scale[h.id] : 1.f);
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
  if (!exact_amx) return served;

  // Queries whose candidates may miss a row of the exact top k: an exact fp32 scan at the same
  // level without AMX (the level's own fp32 kernels), results written over theirs.
  std::vector<int64_t> rows;
  for (int64_t b = 0; b < B; ++b)
    if (redo[size_t(b)]) rows.push_back(b);
  served.rescanned = int64_t(rows.size());
  if (rows.empty()) return served;
  const int64_t R = int64_t(rows.size());
  std::vector<float> q2(size_t(R * p.d)), s2(size_t(R * a.k));
  std::vector<int64_t> i2(size_t(R * a.k)), ex2(size_t(R * std::max<int64_t>(a.E, 1)), -1);
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(&q2[size_t(r * p.d)], p.q + rows[size_t(r)] * p.d, size_t(p.d) * 4);
    for (int64_t e = 0; e < a.E; ++e) ex2[size_t(r * a.E + e)] = a.ex[rows[size_t(r)] * a.E + e];
  }
  Args sub = a;
  sub.p.B = R;
  sub.p.q = q2.data();
  sub.approximate = false;
  sub.fetch = a.k;
  sub.ex = ex2.data();
  sub.out_s = s2.data();
  sub.out_i = i2.data();
  sub.paths.amx_min[p.kind] = int64_t(1) << 62;
  const Served inner = run(sub);
  served.ran |= inner.ran;
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(a.out_s + rows[size_t(r)] * a.k, &s2[size_t(r * a.k)], size_t(a.k) * 4);
    std::memcpy(a.out_i + rows[size_t(r)] * a.k, &i2[size_t(r * a.k)], size_t(a.k) * 8);
  }
  return served;
}

std::mutex g_served_mu;
Served g_served;

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
  a.level = ragfast::isa::current();  // a refused RAGFAST_ISA raises here, with the GIL held
  a.paths = level_paths(a.level);
  Served served;
  {
    py::gil_scoped_release release;
    served = run(a);
  }
  std::lock_guard<std::mutex> lock(g_served_mu);
  g_served = served;
}

const char* const kPathNames[kNumPaths] = {"stream", "qmajor", "packed", "scalar", "amx"};
const char* const kKernelNames[kNumKernelBits] = {"scalar", "stream", "stream2", "qmajor", "packed",
                                                  "packed_bf16q", "packed2", "packed2_pairs", "amx"};
const char* const kKindNames[4] = {"fp32", "fp16", "bf16", "int8"};

// The (level, path, kernels) that served the last topk_ip call of the process.
py::dict topk_ip_last() {
  Served s;
  {
    std::lock_guard<std::mutex> lock(g_served_mu);
    s = g_served;
  }
  py::dict out;
  if (s.level < 0) return out;
  out["isa"] = ragfast::isa::name(s.level);
  out["path"] = kPathNames[s.path];
  out["storage"] = kKindNames[s.kind];
  out["batch"] = s.B;
  py::list k;
  for (int i = 0; i < kNumKernelBits; ++i)
    if (s.ran & (1u << i)) k.append(kKernelNames[i]);
  out["kernels"] = k;
  out["rescanned"] = s.rescanned;
  return out;
}

}  // namespace

// The level named `isa` ("" or "current": the level in use), for topk_ip_paths.
int paths_level(const std::string& isa) {
  if (isa.empty() || isa == "current") return ragfast::isa::current();
  for (int l = 0; l < ragfast::isa::kNumLevels; ++l)
    if (isa == ragfast::isa::name(l)) {
      if (!level_kernels(l)) throw std::invalid_argument("topk_ip_paths: level '" + isa + "' is not compiled in");
      return l;
    }
  throw std::invalid_argument("topk_ip_paths: unknown ISA level '" + isa + "'");
}

py::dict topk_ip_paths(py::dict set, const std::string& isa) {
  const int level = paths_level(isa);
  Paths& paths = level_paths(level);
  for (auto item : set) {
    const std::string key = py::str(item.first);
    auto v = item.second.cast<std::vector<int64_t>>();
    if (v.size() != 4) throw std::invalid_argument("topk_ip_paths: each value is 4 batch sizes (fp32, fp16, bf16, int8)");
    int64_t* dst = key == "qmajor_min"   ? paths.qmajor_min
                   : key == "packed_min" ? paths.packed_min
                   : key == "amx_min"    ? paths.amx_min
                                         : nullptr;
    if (!dst) throw std::invalid_argument("topk_ip_paths: keys are 'qmajor_min', 'packed_min' and 'amx_min'");
    for (int i = 0; i < 4; ++i) dst[i] = std::max<int64_t>(1, v[size_t(i)]);
  }
  const Kernels& K = *level_kernels(level);
  py::dict out;
  out["isa"] = ragfast::isa::name(level);
  out["qmajor_min"] = std::vector<int64_t>(paths.qmajor_min, paths.qmajor_min + 4);
  out["packed_min"] = std::vector<int64_t>(paths.packed_min, paths.packed_min + 4);
  out["amx_min"] = std::vector<int64_t>(paths.amx_min, paths.amx_min + 4);
  py::dict chosen;
  for (int kind = 0; kind < 4; ++kind) {
    py::list l;
    for (int64_t B : {1, 4, 16, 64, 256}) l.append(K.choose_path(kind, B, paths));
    chosen[py::int_(kind)] = l;
  }
  out["path_at_1_4_16_64_256"] = chosen;  // 0 stream, 1 query-major, 2 packed, 3 scalar, 4 amx
  py::dict named;
  for (int kind = 0; kind < 4; ++kind) {
    py::list l;
    for (int64_t B : {1, 4, 16, 64, 256}) l.append(kPathNames[K.choose_path(kind, B, paths)]);
    named[kKindNames[kind]] = l;
  }
  out["paths"] = named;  // the same, by name
  return out;
}

RAGFAST_REGISTER(topk_ip, [](py::module_& m) {
  m.def("topk_ip_last", &topk_ip_last,
        "What served the process's last topk_ip call: {isa, path (stream/qmajor/packed/scalar/amx), storage, batch,\n"
        "kernels (those that scanned rows: scalar, stream, stream2, qmajor, packed, packed_bf16q, packed2,\n"
        "packed2_pairs, amx), rescanned (fp32 or fp16 via AMX: queries rescanned exactly)}; {} before any call.");
  m.def("topk_ip_paths", &topk_ip_paths, py::arg("set") = py::dict(), py::arg("isa") = "",
        "Get (and with `set`, change) the batch sizes at which topk_ip switches kernels, per storage kind "
        "(fp32, fp16, bf16, int8), for ISA level `isa` (default: the level in use). For tests and tuning.");
  m.def("topk_ip", &topk_ip_binding, py::arg("queries"), py::arg("corpus"), py::arg("kind"), py::arg("scale"),
        py::arg("rowsum"), py::arg("rescore"), py::arg("rescore_kind"), py::arg("k"), py::arg("fetch"),
        py::arg("min_score"), py::arg("exclude"), py::arg("out_scores"), py::arg("out_ids"), py::arg("threads") = 0,
        "Fused inner-product top-k over fp32/fp16/bf16/int8 storage (kind 0/1/2/3); writes out_scores/out_ids.\n"
        "bf16/int8 over-fetch `fetch` candidates and re-score them with the fp32 query against `rescore`\n"
        "(or the storage itself). Use ragfast.ops.topk_ip, which validates and allocates.");
});