// 256-bit kernels (TK_PAIRS2): the AVX2 level's stream and packed families, also the plain AVX-512 level's int8 and packed bf16.
// Part of the topk_ip kernels of one ISA level: included only by csrc/topk_ip_kernels.h, inside its
// anonymous namespace, after the parts listed before it there; not a standalone header.
// The TK_* feature macros (TK_SIMD, TK_AVX2, TK_BF16, TK_VNNI, TK_PAIRS2, TK_AMX) are set there
// from the flags the including level file is compiled with.

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
