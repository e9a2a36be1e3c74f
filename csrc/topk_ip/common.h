// Helpers every level uses: the running top-k, scalar and 256-bit conversions, the exact re-score, the generic scan.
// Part of the topk_ip kernels of one ISA level: included only by csrc/topk_ip_kernels.h, inside its
// anonymous namespace, after the parts listed before it there; not a standalone header.
// The TK_* feature macros (TK_SIMD, TK_AVX2, TK_BF16, TK_VNNI, TK_PAIRS2, TK_AMX) are set there
// from the flags the including level file is compiled with.

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

