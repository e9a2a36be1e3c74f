// w8a8: the two elementwise ends of an int8 x int8 linear layer (models/weight_quant.py, w8a8).
//
//   w8a8_quantize: each row of x (fp32 or bf16) to int8 codes with one symmetric scale,
//     scale = max|x| / 127 (1 for a zero row), code = round-half-even(x / scale) in [-127, 127];
//   w8a8_dequantize: y[m, n] = float(acc[m, n]) * xs[m] * ws[n] (+ bias[n]) from the int32 sums of
//     torch._int_mm, written as fp32 or bf16 (round to nearest even);
//   w8a8_matmul (the avx512vnni level and above): the product itself and w8a8_dequantize's
//     scaling in one kernel, on the weight's codes packed once into AMX's tile layout (which is
//     also VNNI's): AMX-INT8 tiles at the amx level (csrc/isa/w8a8_amx.cpp), vpdpbusd below it
//     (csrc/isa/w8a8_avx512vnni.cpp); the same bits as torch._int_mm then w8a8_dequantize.
//
// The first two are what the torch expressions they replace compute, in the same order and precision
// (so the results are the same bits), in one pass each: as ten torch ops they were about 50 ms of
// a 235 ms batch-64 decode step of Qwen2.5-Coder-0.5B (two threads, AMD EPYC Zen 4), mostly the
// copies between int8, int32, fp32 and bf16. The per-ISA row kernels live in
// csrc/isa/w8a8_<level>.cpp; this file holds the portable rows (which the compiler vectorises at
// the build's base level: division and the 1.5 * 2^23 rounding trick need nothing more), the
// dispatcher and the binding, which takes addresses (python/ragfast/ops/w8a8.py checks the
// tensors). Threads split the rows (w8a8_matmul: the output columns).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "bf16_scalar.h"
#include "isa.h"
#include "registry.h"
#include "threads.h"
#include "w8a8_common.h"

namespace py = pybind11;

namespace ragfast {
namespace w8a8_detail {

using namespace ragfast::w8a8_common;

// Elements per thread below which one thread does it all (a 2-thread team costs a few us).
constexpr int64_t kMinPerThread = 1 << 14;

inline uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
inline uint32_t bits(uint16_t h) { return uint32_t(h) << 16; }

template <typename X>
void quantize_rows(const X* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* codes, float* scales) {
  for (int64_t m = m0; m < m1; ++m) {
    const X* r = x + m * ldx;
    // max |x| as the largest sign-cleared bit pattern: for floats that are not NaN the order of
    // the patterns is the order of the values, and an integer maximum vectorises where a float
    // one does not (without -ffast-math).
    uint32_t top = 0;
    for (int64_t k = 0; k < K; ++k) top = std::max(top, bits(r[k]) & 0x7fffffffu);
    float amax;
    std::memcpy(&amax, &top, 4);
    const float s = amax > 0.f ? amax / 127.0f : 1.0f;
    scales[m] = s;
    int8_t* c = codes + m * K;
    // |x / s| <= 127 (+ an ulp), so adding and taking away 1.5 * 2^23 rounds to the nearest integer,
    // ties to even, as torch.round does; the clamp catches the ulp.
    const float magic = 12582912.0f;
    for (int64_t k = 0; k < K; ++k) {
      float q = (widen(r[k]) / s + magic) - magic;
      q = std::min(127.f, std::max(-127.f, q));
      c[k] = int8_t(q);
    }
  }
}

template <bool BF16>
void dequantize_rows(const int32_t* acc, int64_t m0, int64_t m1, int64_t N, const float* xs, const float* ws,
                     const float* bias, void* y, int64_t ldy);

void quantize_row_generic(const void* x, bool bf16, int64_t K, int8_t* codes, float* scale) {
  if (bf16)
    quantize_rows(static_cast<const uint16_t*>(x), K, 0, 1, K, codes, scale);
  else
    quantize_rows(static_cast<const float*>(x), K, 0, 1, K, codes, scale);
}

void dequantize_row_generic(const int32_t* acc, int64_t N, float s, const float* ws, const float* bias, void* y,
                            bool bf16) {
  if (bf16)
    dequantize_rows<true>(acc, 0, 1, N, &s, ws, bias, y, N);
  else
    dequantize_rows<false>(acc, 0, 1, N, &s, ws, bias, y, N);
}

// The row kernels of the ISA level in use (csrc/isa.cpp): every level from avx512 up runs the
// AVX-512 ones; below it, the portable ones.
QuantizeRowFn pick_quantize() {
#ifdef RAGFAST_ISA_HAVE_avx512
  if (isa::current() >= isa::kAvx512) return &w8a8_quantize_row_avx512;
#endif
  return &quantize_row_generic;
}

DequantizeRowFn pick_dequantize() {
#ifdef RAGFAST_ISA_HAVE_avx512
  if (isa::current() >= isa::kAvx512) return &w8a8_dequantize_row_avx512;
#endif
  return &dequantize_row_generic;
}

void w8a8_quantize(uintptr_t x, bool bf16, int64_t M, int64_t K, int64_t ldx, uintptr_t codes, uintptr_t scales,
                   int threads) {
  if (M < 0 || K < 1) throw std::invalid_argument("w8a8_quantize: rows must be >= 0 and each row non-empty");
  if (M > 1 && ldx < K) throw std::invalid_argument("w8a8_quantize: the row stride is shorter than the row");
  if (M == 0) return;
  py::gil_scoped_release release;
  const int T = team_size(threads, std::min(M, M * K / kMinPerThread));
  const QuantizeRowFn row = pick_quantize();
  const size_t width = bf16 ? 2 : 4;
  run_team(T, [&](int t) {
    for (int64_t m = M * t / T; m < M * (t + 1) / T; ++m)
      row(reinterpret_cast<const char*>(x) + size_t(m * ldx) * width, bf16, K, reinterpret_cast<int8_t*>(codes) + m * K,
          reinterpret_cast<float*>(scales) + m);
  });
}

template <bool BF16>
void dequantize_rows(const int32_t* acc, int64_t m0, int64_t m1, int64_t N, const float* xs, const float* ws,
                     const float* bias, void* y, int64_t ldy) {
  for (int64_t m = m0; m < m1; ++m) {
    const int32_t* a = acc + m * N;
    const float s = xs[m];
    if (BF16) {
      uint16_t* o = static_cast<uint16_t*>(y) + m * ldy;
      if (bias)
        for (int64_t n = 0; n < N; ++n) o[n] = float_to_bf16(float(a[n]) * s * ws[n] + bias[n]);
      else
        for (int64_t n = 0; n < N; ++n) o[n] = float_to_bf16(float(a[n]) * s * ws[n]);
    } else {
      float* o = static_cast<float*>(y) + m * ldy;
      if (bias)
        for (int64_t n = 0; n < N; ++n) o[n] = float(a[n]) * s * ws[n] + bias[n];
      else
        for (int64_t n = 0; n < N; ++n) o[n] = float(a[n]) * s * ws[n];
    }
  }
}

void w8a8_dequantize(uintptr_t acc, int64_t M, int64_t N, uintptr_t xs, uintptr_t ws, uintptr_t bias, uintptr_t y,
                     bool bf16, int64_t ldy, int threads) {
  if (M < 0 || N < 1) throw std::invalid_argument("w8a8_dequantize: rows must be >= 0 and each row non-empty");
  if (M > 1 && ldy < N) throw std::invalid_argument("w8a8_dequantize: the row stride is shorter than the row");
  if (M == 0) return;
  py::gil_scoped_release release;
  const int T = team_size(threads, std::min(M, M * N / kMinPerThread));
  const auto* a = reinterpret_cast<const int32_t*>(acc);
  const auto* x = reinterpret_cast<const float*>(xs);
  const auto* w = reinterpret_cast<const float*>(ws);
  const auto* b = reinterpret_cast<const float*>(bias);
  const DequantizeRowFn row = pick_dequantize();
  const size_t width = bf16 ? 2 : 4;
  run_team(T, [&](int t) {
    for (int64_t m = M * t / T; m < M * (t + 1) / T; ++m)
      row(a + m * N, N, x[m], w, b, reinterpret_cast<char*>(y) + size_t(m * ldy) * width, bf16);
  });
}

// The level whose product runs here: amx (tiles), avx512vnni and avx512bf16 (VNNI), else none.
enum class Product { kNone, kVnni, kTiles };

Product product() {
#ifdef RAGFAST_ISA_HAVE_amx
  if (isa::current() >= isa::kAmx) return Product::kTiles;
#endif
#ifdef RAGFAST_ISA_HAVE_avx512vnni
  if (isa::current() >= isa::kAvx512Vnni) return Product::kVnni;
#endif
  return Product::kNone;
}

bool matmul_available() { return product() != Product::kNone; }

void w8a8_matmul(uintptr_t xq, int64_t M, int64_t K, uintptr_t xs, uintptr_t packed, int64_t N, uintptr_t ws,
                 uintptr_t bias, uintptr_t y, bool bf16, int64_t ldy, int threads, bool silu) {
  const Product how = product();
  if (how == Product::kNone) throw std::runtime_error("w8a8_matmul: needs the avx512vnni ISA level or above");
  if (M < 0 || N < 1 || K < 64 || K % 64) throw std::invalid_argument("w8a8_matmul: needs M >= 0, N >= 1, K a multiple of 64");
  if (silu && (N % 128 || bias)) throw std::invalid_argument("w8a8_matmul: silu needs N a multiple of 128 and no bias");
  const int64_t width = silu ? N / 2 : N;  // output columns
  if (M > 1 && ldy < width) throw std::invalid_argument("w8a8_matmul: the row stride is shorter than the row");
  if (M == 0) return;
  py::gil_scoped_release release;
  const auto* x = reinterpret_cast<const int8_t*>(xq);
  const auto* xsp = reinterpret_cast<const float*>(xs);
  const auto* w = reinterpret_cast<const int8_t*>(packed);
  const auto* wsp = reinterpret_cast<const float*>(ws);
  const auto* b = reinterpret_cast<const float*>(bias);
  void* out = reinterpret_cast<void*>(y);
  const int64_t stride = M > 1 ? ldy : width;
  // Threads split the column groups in pairs (with silu in whole strips of 8: a gate's 64 columns
  // and the up projection's beside them); every thread reads all the rows (they stay in its L2).
  // On tiles a product under about 2^26 multiply-adds (64 rows of the 0.5B's 896 x 896 and
  // 128 x 896 layers) ran as fast or faster on one thread than on a team of two (Xeon, AMX);
  // VNNI multiplies 16x slower per core, so a team pays from about 2^22 (Zen 4).
  const int64_t groups = (N + 15) / 16, unit = silu ? 8 : 2, units = (groups + unit - 1) / unit;
  const int64_t per_thread = int64_t(1) << (how == Product::kTiles ? 26 : 22);
  const int T = team_size(threads, std::min(units, M * N * K / per_thread + 1));
  auto cols = [&](int t, int64_t& j0, int64_t& j1) {
    j0 = unit * (units * t / T);
    j1 = std::min(groups, unit * (units * (t + 1) / T));
  };
  if (how == Product::kVnni) {
#ifdef RAGFAST_ISA_HAVE_avx512vnni
    run_team(T, [&](int t) {
      int64_t j0, j1;
      cols(t, j0, j1);
      if (j0 < j1) w8a8_matmul_cols_avx512vnni(x, M, K, xsp, w, N, j0, j1, wsp, b, out, stride, bf16, silu);
    });
#endif
    return;
  }
#ifdef RAGFAST_ISA_HAVE_amx
  // The last partial 16-row group, zero padded: a tile load reads 16 whole rows.
  std::vector<int8_t> tail;
  if (M % 16) {
    tail.assign(size_t(16 * K), 0);
    std::memcpy(tail.data(), x + (M / 16) * 16 * K, size_t((M % 16) * K));
  }
  run_team(T, [&](int t) {
    int64_t j0, j1;
    cols(t, j0, j1);
    if (j0 < j1)
      w8a8_matmul_cols_amx(x, tail.empty() ? nullptr : tail.data(), M, K, xsp, w, N, j0, j1, wsp, b, out, stride,
                           bf16, silu);
  });
#endif
#if !defined(RAGFAST_ISA_HAVE_amx) && !defined(RAGFAST_ISA_HAVE_avx512vnni)
  (void)x, (void)xsp, (void)w, (void)wsp, (void)b, (void)out, (void)stride, (void)cols;  // refused above
#endif
}

}  // namespace w8a8_detail
}  // namespace ragfast

RAGFAST_REGISTER(w8a8, [](py::module_& m) {
  using namespace ragfast::w8a8_detail;
  m.def("w8a8_quantize", &w8a8_quantize, py::arg("x"), py::arg("bf16"), py::arg("M"), py::arg("K"), py::arg("ldx"),
        py::arg("codes"), py::arg("scales"), py::arg("threads") = 0,
        "w8a8_quantize(x, bf16, M, K, ldx, codes, scales, threads=0)\n"
        "codes[M, K] (int8, contiguous) and scales[M] (fp32) of the rows of x (fp32, or bf16 when bf16; rows ldx\n"
        "elements apart): scale = max|row| / 127 (1 for a zero row), code = round-half-even(x / scale).\n"
        "Use ragfast.ops.w8a8.quantize_rows, which checks the tensors; this does not.");
  m.def("w8a8_dequantize", &w8a8_dequantize, py::arg("acc"), py::arg("M"), py::arg("N"), py::arg("xs"), py::arg("ws"),
        py::arg("bias"), py::arg("y"), py::arg("bf16"), py::arg("ldy"), py::arg("threads") = 0,
        "w8a8_dequantize(acc, M, N, xs, ws, bias, y, bf16, ldy, threads=0)\n"
        "y[m, n] = float(acc[m, n]) * xs[m] * ws[n] (+ bias[n]; 0 address: none) from contiguous int32 sums,\n"
        "written as fp32, or bf16 when bf16 (rows ldy elements apart). Use ragfast.ops.w8a8.dequantize_sums.");
  m.def("w8a8_matmul_available", &matmul_available, "Whether w8a8_matmul runs here (the avx512vnni ISA level or above).");
  m.def("w8a8_matmul", &w8a8_matmul, py::arg("xq"), py::arg("M"), py::arg("K"), py::arg("xs"), py::arg("packed"),
        py::arg("N"), py::arg("ws"), py::arg("bias"), py::arg("y"), py::arg("bf16"), py::arg("ldy"),
        py::arg("threads") = 0, py::arg("silu") = false,
        "w8a8_matmul(xq, M, K, xs, packed, N, ws, bias, y, bf16, ldy, threads=0, silu=False)\n"
        "y = w8a8_dequantize(xq @ codes.T, xs, ws, bias): int8 codes xq[M, K] (contiguous, K a multiple of 64)\n"
        "times the weight's codes [N, K] packed by ragfast.ops.w8a8.pack_codes: AMX-INT8 at the amx level, VNNI at\n"
        "avx512vnni and avx512bf16, refused below.\n"
        "silu: the codes are a gate and an up projection interleaved by 64 rows (pack_gate_up; N a multiple\n"
        "of 128, no bias) and y[M, N / 2] = silu(gate) * up, each dequantised as above.\n"
        "Use ragfast.ops.w8a8.matmul, which checks the tensors; this does not.");
});
