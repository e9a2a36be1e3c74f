// silu_mul: silu(gate) * up, the gated activation between a SwiGLU MLP's two matmuls (Llama,
// Qwen2: down_proj(act_fn(gate_proj(x)) * up_proj(x))).
//
// Why a kernel: torch computes the activation into one new tensor and the product into another,
// two passes over [tokens, intermediate] values (4,864 per token in Qwen2.5-0.5B: 18.7 MB per
// tensor in bf16 for a 1,920-token prefill pass). One pass reads gate and up once and writes once.
//
// The AVX-512 row kernel lives in csrc/isa/silu_mul_avx512.cpp; this file holds the portable one,
// the dispatcher and the binding, which takes addresses (python/ragfast/ops/silu_mul.py checks the
// tensors and keeps them alive).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "bf16_scalar.h"
#include "isa.h"
#include "registry.h"
#include "silu_mul_common.h"
#include "threads.h"

namespace py = pybind11;

namespace ragfast {
namespace silu_mul_detail {

using namespace ragfast::silu_mul_common;

constexpr int64_t kMinValuesPerThread = 1 << 15;

void silu_mul_row_generic(const void* g, const void* u, void* y, int64_t n, bool bf16) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = load_float(g, i, bf16);
    const float s = a / (1.f + std::exp(-a));
    if (bf16)  // torch rounds the activation to bf16 before the product
      static_cast<uint16_t*>(y)[i] = float_to_bf16(bf16_to_float(float_to_bf16(s)) * load_float(u, i, true));
    else
      static_cast<float*>(y)[i] = s * load_float(u, i, false);
  }
}

// The row kernel of the ISA level in use; every level from avx512 up runs the AVX-512 one.
RowFn pick_row() {
#ifdef RAGFAST_ISA_HAVE_avx512
  if (isa::current() >= isa::kAvx512) return &silu_mul_row_avx512;
#endif
  return &silu_mul_row_generic;
}

void silu_mul(uintptr_t g_addr, int64_t ldg, uintptr_t u_addr, int64_t ldu, uintptr_t y_addr, int64_t M, int64_t N,
              bool bf16, int threads) {
  if (M < 0 || N < 1) throw std::invalid_argument("silu_mul: rows must be >= 0 and each row non-empty");
  if (M > 1 && (ldg < N || ldu < N)) throw std::invalid_argument("silu_mul: a row stride is shorter than the row");
  if (M == 0) return;
  const RowFn row = pick_row();
  const size_t width = bf16 ? 2 : 4;
  const char* g = reinterpret_cast<const char*>(g_addr);
  const char* u = reinterpret_cast<const char*>(u_addr);
  char* y = reinterpret_cast<char*>(y_addr);
  py::gil_scoped_release release;
  const int T = team_size(threads, std::min(M, M * N / kMinValuesPerThread));
  run_team(T, [&](int t) {
    for (int64_t m = M * t / T; m < M * (t + 1) / T; ++m)
      row(g + size_t(m * ldg) * width, u + size_t(m * ldu) * width, y + size_t(m * N) * width, N, bf16);
  });
}

}  // namespace silu_mul_detail
}  // namespace ragfast

RAGFAST_REGISTER(silu_mul, [](py::module_& m) {
  using namespace ragfast::silu_mul_detail;
  m.def("silu_mul", &silu_mul, py::arg("g"), py::arg("ldg"), py::arg("u"), py::arg("ldu"), py::arg("y"), py::arg("M"),
        py::arg("N"), py::arg("bf16"), py::arg("threads") = 0,
        "silu_mul(g, ldg, u, ldu, y, M, N, bf16, threads=0)\n"
        "y[m, :N] (rows N apart) = silu(g[m]) * u[m], rows ldg / ldu elements apart, fp32 or bf16 (rounded\n"
        "after the activation and after the product, as torch in that dtype). Use\n"
        "ragfast.ops.silu_mul.silu_mul, which checks the tensors; this does not.");
});
