// AMX tile kernels (TK_AMX): tdpbf16ps / tdpbssd scans for the amx level.
// Part of the topk_ip kernels of one ISA level: included only by csrc/topk_ip_kernels.h, inside its
// anonymous namespace, after the parts listed before it there; not a standalone header.
// The TK_* feature macros (TK_SIMD, TK_AVX2, TK_BF16, TK_VNNI, TK_PAIRS2, TK_AMX) are set there
// from the flags the including level file is compiled with.

#if defined(TK_AMX)
// ---------------------------------------------------------------------------- AMX tile kernels
// C[16 rows x 16 queries] += A[16 rows x 64 bytes of depth] * B[depth x 16 queries]:
//  * A is the corpus read in place, row-major (tileloadd takes the row stride), so the corpus
//    is never packed: bf16 storage 32 depth elements per tile row, int8 64, and fp32 or fp16
//    rows converted to bf16 16 rows at a time (the bf16 first pass of their exact search);
//  * B is the queries in VNNI layout (32-bit words of a depth pair or quad), made once per call
//    by the dispatcher (Problem::qt) and packed per tile: the tile of query block j and depth
//    chunk c is the 1 KB at qt + (j * nchunks + c) * 256 words, rows 64 bytes apart;
//  * int8 multiplies signed codes by signed codes (tdpbssd: exact int32, no +128 offset and
//    row-sum correction), scaled as pk_i8 does;
//  * the running top-k is fed from each 16 x 16 result: one vector compare per corpus row
//    against the 16 queries' thresholds, pushes are rare.
// Blocking: 2 row groups x 2 query blocks = 4 accumulator tiles (tmm0-3), 2 A tiles (tmm4-5),
// 2 B tiles (tmm6-7): 4 tile multiplies per 4 tile loads. A group whose last 64-byte chunk
// runs past d, or with fewer than 16 rows, is read from a zero-padded copy (reading past a row
// could touch NaN bf16 bit patterns, which 0 * NaN would spread, or unmapped memory).

// fp16 has no tile multiply on this level (AMX-FP16 is Granite Rapids'): its rows take the fp32
// route, converted to bf16 and re-scored exactly against the fp16 rows.
bool amx_supported(int kind) { return kind == kF32 || kind == kF16 || kind == kBF16 || kind == kI8; }

// Whether the A tiles are rows converted to bf16 (fp32, fp16) rather than the corpus in place.
inline bool amx_converted(int kind) { return kind == kF32 || kind == kF16; }

// Every tile 16 rows x 64 bytes (csrc/isa/amx_tiles.h, included by csrc/isa/topk_ip_amx.cpp).
inline void amx_configure() { ::ragfast::amx_tiles::configure_16x64(); }

// Bytes of one A-tile row of depth: bf16 (also fp32 and fp16 converted) 2 per element, int8 1.
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

// 16 elements of an fp32 or fp16 row as fp32 (the first n real, the rest 0; nothing past them read).
template <int KIND>
inline __m512 amx_load16(const char* row, int64_t j, int64_t n) {
  const __mmask16 m = m16(n > 0 ? n : 0);
  if constexpr (KIND == kF16)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(row) + j));
  else
    return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(row) + j);
}

// fp32 or fp16 rows -> bf16 (round to nearest even, vcvtne2ps2bf16; fp16 values are all normal
// in bf16's range, so each is rounded once, as an fp32 row's are), zero padded to `rb` bytes;
// returns the row's sum of squares (fp32), for the error bound of the exact pass.
template <int KIND>
inline float amx_row_convert(const char* x, int64_t d, int64_t rb, uint16_t* out) {
  __m512 ss = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < d; j += 32) {
    const __m512 a = amx_load16<KIND>(x, j, d - j);
    const __m512 b = amx_load16<KIND>(x, j + 16, d - j - 16);
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
  if (amx_converted(p.kind)) {
    float mx = *sumsq;
    for (int r = 0; r < 16; ++r) {
      uint16_t* out = reinterpret_cast<uint16_t*>(buf + r * rb);
      if (r < rows) {
        const float s = p.kind == kF16 ? amx_row_convert<kF16>(row_of(p, g0 + r), p.d, rb, out)
                                       : amx_row_convert<kF32>(row_of(p, g0 + r), p.d, rb, out);
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
// `out` ([g * 2 + q][16][16]) unless `fresh`. pf: the first of `pf_rows` rows of the next
// group pair to prefetch, else nullptr.
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
  const int64_t nchunks = amx_rowbytes(p) / 64;
  const char* qb = reinterpret_cast<const char*>(p.qt + (b0 / 16) * nchunks * 256);
  const int64_t qnext = nchunks * 1024;  // the next query block's tile of the same chunk
  for (int64_t c = c0; c < c1; ++c) {
    int64_t s0, s1 = 0;
    const char* a0 = amx_a(src[0], c, s0);
    const char* a1 = NG > 1 ? amx_a(src[1], c, s1) : nullptr;
    const char* bq = qb + c * 1024;
    if (pf)  // the next group's chunk c, one line per row, into L2 (see scan_amx)
      for (int r = 0; r < pf_rows; ++r) _mm_prefetch(pf + r * p.rs * p.esize + c * 64, _MM_HINT_T2);
    _tile_loadd(4, a0, s0);
    _tile_loadd(6, bq, 64);
    if constexpr (NQ > 1) _tile_loadd(7, bq + qnext, 64);
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
    // Prefetch the next 32 rows while these are scored: the tile loads read 16 rows side by
    // side, which the hardware prefetchers follow poorly. fp32 and fp16 groups are converted row
    // by row (sequential reads), so they need none. The prefetches go to L2 and, from B = 33,
    // half of them ride on each of the first two query pairs: 32 L1 prefetches in a row filled
    // the line-fill buffers and stalled the tile loads behind them (36% of the cycles in
    // `perf`). Against 32 L1 prefetches in the first query pair, 2 x 16 into L2 took bf16
    // 31-38 against 38-46 ms at B = 64 and int8 18-23 against 19-25 ms (200,000 x 768, k = 10,
    // 2 threads, in-process round-robin, Intel Xeon with AMX, load 3).
    const int pf_all = int(imin(32, imax(0, r1 - t0 - 32)));
    const char* pf = pf_all > 0 && !amx_converted(p.kind) ? row_of(p, t0 + 32) : nullptr;
    const bool pf_split = p.B > 32;
    const int pf_half = pf_all / 2;
    for (int64_t c0 = 0; c0 < nchunks; c0 += kAmxDepthBlock) {
      const int64_t c1 = imin(nchunks, c0 + kAmxDepthBlock);
      const bool fresh = c0 == 0, last = c1 == nchunks;
      for (int64_t b0 = 0; b0 < p.B; b0 += 32) {
        const int nq = p.B - b0 > 16 ? 2 : 1;
        const char* f = nullptr;
        int pf_rows = 0;
        if (pf && b0 == 0) {
          f = pf;
          pf_rows = pf_split ? pf_half : pf_all;
        } else if (pf && pf_split && b0 == 32) {
          f = pf + int64_t(pf_half) * p.rs * p.esize;
          pf_rows = pf_all - pf_half;
        }
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
