// AVX-512 kernels (TK_SIMD): stream, packed and query-major families, with BF16 / VNNI first passes where the level has them.
// Part of the topk_ip kernels of one ISA level: included only by csrc/topk_ip_kernels.h, inside its
// anonymous namespace, after the parts listed before it there; not a standalone header.
// The TK_* feature macros (TK_SIMD, TK_AVX2, TK_BF16, TK_VNNI, TK_PAIRS2, TK_AMX) are set there
// from the flags the including level file is compiled with.

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
