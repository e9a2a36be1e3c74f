// gemv: y[M, N] = x[M, K] . w[N, K]^T (* scale[N]) (+ bias[N]) for a few rows of x.
//
// Decoding a batch of one to a few sequences multiplies a few activation rows by every weight
// matrix of the model once per token: the time is the weight bytes over the memory bandwidth,
// and the arithmetic is idle. A GEMM library tuned for large M leaves bandwidth unused there
// (oneDNN's bf16 M = 1 matmuls read 16.5 GB/s of the 31 GB/s a 2-core Zen 4 EPYC streams). These
// kernels read each weight row front to back as one stream and multiply every row of x with it:
// bf16 pairs through vdpbf16ps where the level has it, int8 weights under bf16 x through vpdpbusd
// where the level has VNNI (x as 23-bit fixed point), else widened to fp32 in registers (bf16 by
// a shift, int8 by a sign extension); the threads split the output rows. Weights are fp32, bf16
// or int8 codes with one fp32 scale per output row; x and y are fp32 or bf16 (y rounded to
// nearest even), sums are fp32.
//
// The per-ISA block kernels live in csrc/isa/gemv_<level>.cpp; this file holds the portable one,
// the dispatcher and the binding. The binding takes addresses (the Python wrapper,
// python/ragfast/ops/gemv.py, checks shapes, dtypes, strides and devices of torch tensors and
// keeps them alive): a decode step makes about 170 of these calls, and numpy views of bf16
// tensors cost more than the smaller matrices' kernels.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "bf16_scalar.h"
#include "gemv_common.h"
#include "isa.h"
#include "registry.h"
#include "silu_mul_common.h"
#include "threads.h"

namespace py = pybind11;

namespace ragfast {
namespace gemv_detail {

using namespace ragfast::gemv_common;

// Output rows per thread below which one thread does it all: a 2-thread team costs a few
// microseconds, a 64-row block of a 896-deep bf16 matrix about as much.
constexpr int64_t kMinRowsPerThread = 64;

// The portable block: each weight row read front to back once (one stream, as the SIMD levels
// do), against every row of x, with 8 partial sums the compiler can keep in vector lanes.
template <typename W>
void block_generic(const float* x, int64_t M, int64_t K, const W* w, int64_t ldw, int64_t n0, int64_t n1, float* y,
                   int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* r = w + n * ldw;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; ++j) a[j] += xm[k + j] * widen(r[k + j]);
      float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
      for (; k < K; ++k) s += xm[k] * widen(r[k]);
      y[m * ldy + n] = s;
    }
  }
}

void gemv_block_generic(const float* x, int64_t M, int64_t K, const void* w, int kind, int64_t ldw, int64_t n0,
                        int64_t n1, float* y, int64_t ldy) {
  switch (kind) {
    case kF32: return block_generic(x, M, K, static_cast<const float*>(w), ldw, n0, n1, y, ldy);
    case kBF16: return block_generic(x, M, K, static_cast<const uint16_t*>(w), ldw, n0, n1, y, ldy);
    default: return block_generic(x, M, K, static_cast<const int8_t*>(w), ldw, n0, n1, y, ldy);
  }
}

// The block kernel of the ISA level in use (csrc/isa.cpp). Levels are ordered
// (csrc/isa_levels.h): every level from avx512 up runs the AVX-512 block for fp32 and int8
// weights (and bf16 weights under fp32 x); bf16 x bf16 has its own block where the level has
// vdpbf16ps (pick_bf16_block).
BlockFn pick_block() {
  const int level = isa::current();
#ifdef RAGFAST_ISA_HAVE_avx512
  if (level >= isa::kAvx512) return &gemv_block_avx512;
#endif
#ifdef RAGFAST_ISA_HAVE_avx2
  if (level >= isa::kAvx2) return &gemv_block_avx2;
#endif
  (void)level;
  return &gemv_block_generic;
}

// The bf16 x bf16 block of the level in use, or nullptr where the level has no bf16 dot product
// (the weights are then widened to fp32 like the others').
Bf16BlockFn pick_bf16_block() {
#ifdef RAGFAST_ISA_HAVE_avx512bf16
  if (isa::current() >= isa::kAvx512Bf16) return &gemv_block_bf16_avx512bf16;
#endif
  return nullptr;
}

// Whether int8 weights times bf16 x take the VNNI block (see csrc/isa/gemv_avx512vnni.cpp).
bool i8_vnni() {
#ifdef RAGFAST_ISA_HAVE_avx512vnni
  return isa::current() >= isa::kAvx512Vnni;
#else
  return false;
#endif
}

#ifdef RAGFAST_ISA_HAVE_avx512vnni
// x's rows as the VNNI blocks' fixed-point parts, in this thread's buffers; false if x holds NaN or
// infinity (the caller then takes another path).
bool prepare_i8(uintptr_t x_addr, int64_t ldx, I8Parts& xp) {
  thread_local std::vector<int8_t> parts;
  thread_local std::vector<int32_t> corr;
  thread_local std::vector<float> xscale;
  parts.resize(size_t(xp.M * 3 * xp.Kp));  // prepare writes every byte, the padding too
  corr.resize(size_t(xp.M * 3 * 16));
  xscale.resize(size_t(xp.M));
  xp.parts = parts.data();
  xp.corr = corr.data();
  xp.scale = xscale.data();
  return gemv_i8_prepare_avx512vnni(reinterpret_cast<const uint16_t*>(x_addr), ldx, xp);
}
#endif

void gemv(uintptr_t x_addr, bool x_bf16, int64_t M, int64_t K, int64_t ldx, uintptr_t w_addr, int kind, int64_t N,
          int64_t ldw, uintptr_t scale_addr, uintptr_t bias_addr, uintptr_t y_addr, int64_t ldy, int threads) {
  if (M < 0 || K < 0 || N < 0) throw std::invalid_argument("gemv: negative size");
  if (kind != kF32 && kind != kBF16 && kind != kI8) throw std::invalid_argument("gemv: unknown weight kind");
  if (ldx < K || ldw < K || ldy < N) throw std::invalid_argument("gemv: a row stride is shorter than its row");
  if (kind == kI8 && !scale_addr) throw std::invalid_argument("gemv: int8 weights need their scales");
  if (M == 0 || N == 0) return;
  const BlockFn block = pick_block();
  const Bf16BlockFn bf16_block = x_bf16 && kind == kBF16 ? pick_bf16_block() : nullptr;
  const auto* scale = reinterpret_cast<const float*>(scale_addr);
  const auto* bias = reinterpret_cast<const float*>(bias_addr);
  py::gil_scoped_release release;
  // x copied once, contiguous: as bf16 for the bf16 dot product, as fixed-point bytes for int8
  // weights at VNNI levels, else widened to fp32; the raw sums go to an fp32 [M, N] block.
  thread_local std::vector<float> xs, ys;
  thread_local std::vector<uint16_t> xh;
  ys.resize(size_t(M * N));
  float* yf = ys.data();
  float* xf = nullptr;
  const uint16_t* xb = nullptr;
  I8Parts xp{M, K, (K + 63) / 64 * 64, nullptr, nullptr, nullptr};
  bool i8 = false;
#ifdef RAGFAST_ISA_HAVE_avx512vnni
  // Up to 2^20 deep: past it a lane's int32 sum of (w + 128) * part could overflow.
  if (kind == kI8 && x_bf16 && K <= (int64_t(1) << 20) && i8_vnni()) i8 = prepare_i8(x_addr, ldx, xp);
#endif
  if (i8) {
    // prepared above
  } else if (bf16_block) {
    xh.resize(size_t(M * K));
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(xh.data() + m * K, reinterpret_cast<const uint16_t*>(x_addr) + m * ldx, size_t(K) * 2);
    xb = xh.data();
  } else {
    xs.resize(size_t(M * K));
    xf = xs.data();
    for (int64_t m = 0; m < M; ++m) {
      if (x_bf16) {
        const auto* src = reinterpret_cast<const uint16_t*>(x_addr) + m * ldx;
        for (int64_t k = 0; k < K; ++k) xf[m * K + k] = bf16_to_float(src[k]);
      } else {
        std::memcpy(xf + m * K, reinterpret_cast<const float*>(x_addr) + m * ldx, size_t(K) * sizeof(float));
      }
    }
  }
  const void* w = reinterpret_cast<const void*>(w_addr);
  const int T = team_size(threads, N / kMinRowsPerThread);
  // Contiguous ranges of output rows (multiples of 4), one per thread, then the epilogue on the same range.
  const int64_t tiles = (N + 3) / 4;
  auto run = [&](int t) {
    const int64_t n0 = std::min(N, tiles * t / T * 4);
    const int64_t n1 = std::min(N, tiles * (t + 1) / T * 4);
    if (n0 >= n1) return;
#ifdef RAGFAST_ISA_HAVE_avx512vnni
    if (i8)
      gemv_block_i8_avx512vnni(xp, static_cast<const int8_t*>(w), ldw, n0, n1, yf, N);
    else
#endif
    if (bf16_block)
      bf16_block(xb, M, K, static_cast<const uint16_t*>(w), ldw, n0, n1, yf, N);
    else
      block(xf, M, K, w, kind, ldw, n0, n1, yf, N);
    for (int64_t m = 0; m < M; ++m) {
      const float* src = yf + m * N;
      for (int64_t n = n0; n < n1; ++n) {
        float v = src[n];
        if (scale) v *= scale[n];
        if (bias) v += bias[n];
        if (x_bf16)
          reinterpret_cast<uint16_t*>(y_addr)[m * ldy + n] = float_to_bf16(v);
        else
          reinterpret_cast<float*>(y_addr)[m * ldy + n] = v;
      }
    }
  };
  run_team(T, run);
}

// Output rows of a SiLU pair's strip (python/ragfast/ops/w8a8.py, interleave_gate_up): 64 gate
// rows, then the 64 up rows of the same outputs.
constexpr int64_t kStripRows = 128;

// gemv on int8 codes in w8a8's packed layout, bf16 x and y, at levels with VNNI: the same outputs
// as gemv on the codes' row-major copy up to the order of the fp32 additions (the int32 sums are
// exact in both). With `silu`, the codes are a gate and an up projection interleaved by 64 rows
// (N a multiple of 128, no bias), and y gets N / 2 values: silu(gate) * up as silu_mul's row
// computes it from the two projections' bf16 outputs. False, with nothing written, where x holds
// NaN or infinity or the level has no VNNI (the caller runs the row-major gemv).
bool gemv_packed(uintptr_t x_addr, int64_t M, int64_t K, int64_t ldx, uintptr_t packed_addr, int64_t N,
                 uintptr_t scale_addr, uintptr_t bias_addr, uintptr_t y_addr, int64_t ldy, bool silu, int threads) {
  if (M < 0 || K < 0 || N < 0) throw std::invalid_argument("gemv_packed: negative size");
  if (K % 64 || K > (int64_t(1) << 20)) throw std::invalid_argument("gemv_packed: K must be a multiple of 64");
  if (silu && (N % kStripRows || bias_addr)) throw std::invalid_argument("gemv_packed: a SiLU pair is 128-row strips, no bias");
  if (ldx < K || ldy < (silu ? N / 2 : N)) throw std::invalid_argument("gemv_packed: a row stride is shorter than its row");
  if (!scale_addr) throw std::invalid_argument("gemv_packed: int8 codes need their scales");
  if (M == 0 || N == 0) return true;
#ifdef RAGFAST_ISA_HAVE_avx512vnni
  if (!i8_vnni()) return false;
  py::gil_scoped_release release;
  I8Parts xp{M, K, K, nullptr, nullptr, nullptr};
  if (!prepare_i8(x_addr, ldx, xp)) return false;
  const int64_t G = (N + 15) / 16, ldf = G * 16;
  thread_local std::vector<float> ys;
  ys.resize(size_t(M * ldf));
  float* yf = ys.data();
  const auto* packed = reinterpret_cast<const int8_t*>(packed_addr);
  const auto* scale = reinterpret_cast<const float*>(scale_addr);
  const auto* bias = reinterpret_cast<const float*>(bias_addr);
  auto* y = reinterpret_cast<uint16_t*>(y_addr);
  // Threads take contiguous runs of units: column groups, or whole strips (8 groups) with silu.
  const int64_t per = silu ? kStripRows / 16 : 1, units = (G + per - 1) / per;
  const int T = team_size(threads, units * per * 16 / kMinRowsPerThread);
  auto run = [&](int t) {
    const int64_t g0 = units * t / T * per, g1 = std::min(G, units * (t + 1) / T * per);
    if (g0 >= g1) return;
    gemv_block_i8_packed_avx512vnni(xp, packed, g0, g1, yf, ldf);
    const int64_t n0 = g0 * 16, n1 = std::min(N, g1 * 16);
    for (int64_t m = 0; m < M; ++m) {
      float* src = yf + m * ldf;
      if (!silu) {
        for (int64_t n = n0; n < n1; ++n) y[m * ldy + n] = float_to_bf16(src[n] * scale[n] + (bias ? bias[n] : 0.f));
        continue;
      }
      uint16_t gate[kStripRows / 2], up[kStripRows / 2];
      for (int64_t s0 = n0; s0 < n1; s0 += kStripRows) {
        for (int64_t c = 0; c < kStripRows / 2; ++c) {
          gate[c] = float_to_bf16(src[s0 + c] * scale[s0 + c]);
          up[c] = float_to_bf16(src[s0 + kStripRows / 2 + c] * scale[s0 + kStripRows / 2 + c]);
        }
        silu_mul_common::silu_mul_row_avx512(gate, up, y + m * ldy + s0 / 2, kStripRows / 2, true);
      }
    }
  };
  run_team(T, run);
  return true;
#else
  (void)x_addr; (void)ldx; (void)packed_addr; (void)scale_addr; (void)bias_addr; (void)y_addr; (void)threads;
  return false;
#endif
}

}  // namespace gemv_detail
}  // namespace ragfast

RAGFAST_REGISTER(gemv, [](py::module_& m) {
  using namespace ragfast::gemv_detail;
  m.def("gemv", &gemv, py::arg("x"), py::arg("x_bf16"), py::arg("M"), py::arg("K"), py::arg("ldx"), py::arg("w"),
        py::arg("kind"), py::arg("N"), py::arg("ldw"), py::arg("scale"), py::arg("bias"), py::arg("y"),
        py::arg("ldy"), py::arg("threads") = 0,
        "gemv(x, x_bf16, M, K, ldx, w, kind, N, ldw, scale, bias, y, ldy, threads=0)\n"
        "y[M,N] = x[M,K] . w[N,K]^T (* scale[N]) (+ bias[N]) on raw addresses (0: no scale / bias).\n"
        "kind: 0 fp32, 1 bf16, 2 int8 codes (scale required). x and y share a dtype: fp32, or bf16\n"
        "when x_bf16. Use ragfast.ops.gemv.gemv, which checks the tensors; this does not.");
  m.def("gemv_packed", &gemv_packed, py::arg("x"), py::arg("M"), py::arg("K"), py::arg("ldx"), py::arg("packed"),
        py::arg("N"), py::arg("scale"), py::arg("bias"), py::arg("y"), py::arg("ldy"), py::arg("silu") = false,
        py::arg("threads") = 0,
        "gemv_packed(x, M, K, ldx, packed, N, scale, bias, y, ldy, silu=False, threads=0) -> bool\n"
        "bf16 y[M,N] = x[M,K] . codes[N,K]^T * scale[N] (+ bias[N]) on int8 codes in w8a8's packed layout;\n"
        "with silu, y[M,N/2] = silu(gate) * up of a gate/up pair interleaved by 64 rows. False where\n"
        "x holds NaN or infinity or the level has no VNNI. Use ragfast.ops.gemv.gemv_packed.");
});
