// rms_norm: each row scaled by the reciprocal of its root mean square, then by a weight, as the
// RMSNorm of transformers' Llama and Qwen2 models computes it (fp32 inside, the input's dtype out).
//
// Why a kernel: torch runs that module as six ops, each a pass over the rows with an fp32
// intermediate (widen, square, mean, rsqrt, scale, narrow, times the weight). A prefill pass of
// 1,920 tokens of Qwen2.5-0.5B spent 2.4 ms in each of its 49 norms in bf16 (Intel Xeon, two
// threads); one pass that reads the row twice from cache and writes it once does the same work.
//
// The AVX-512 row kernel lives in csrc/isa/rms_norm_avx512.cpp; this file holds the portable
// one, the dispatcher and the binding, which takes addresses (python/ragfast/ops/rms_norm.py
// checks the tensors and keeps them alive).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "bf16_scalar.h"
#include "isa.h"
#include "registry.h"
#include "rms_norm_common.h"
#include "threads.h"

namespace py = pybind11;

namespace ragfast {
namespace rms_norm_detail {

using namespace ragfast::rms_norm_common;

// Values per thread below which one thread does it all (a team costs a few microseconds).
constexpr int64_t kMinValuesPerThread = 1 << 15;

void rms_norm_row_generic(const void* x, const void* w, void* y, int64_t n, float eps, bool bf16) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_float(x, i, bf16);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    if (bf16) {
      const float t = bf16_to_float(float_to_bf16(load_float(x, i, true) * inv));
      static_cast<uint16_t*>(y)[i] = float_to_bf16(load_float(w, i, true) * t);
    } else {
      static_cast<float*>(y)[i] = static_cast<const float*>(w)[i] * (static_cast<const float*>(x)[i] * inv);
    }
  }
}

// The row kernel of the ISA level in use (csrc/isa.cpp); every level from avx512 up runs the
// AVX-512 one. Below it the portable loop (the Python layer keeps torch's module there).
RowFn pick_row() {
#ifdef RAGFAST_ISA_HAVE_avx512
  if (isa::current() >= isa::kAvx512) return &rms_norm_row_avx512;
#endif
  return &rms_norm_row_generic;
}

void rms_norm(uintptr_t x_addr, int64_t ldx, uintptr_t w_addr, uintptr_t y_addr, int64_t M, int64_t N, double eps,
              bool bf16, int threads) {
  if (M < 0 || N < 1) throw std::invalid_argument("rms_norm: rows must be >= 0 and each row non-empty");
  if (M > 1 && ldx < N) throw std::invalid_argument("rms_norm: the row stride is shorter than the row");
  if (M == 0) return;
  const RowFn row = pick_row();
  const size_t width = bf16 ? 2 : 4;
  const char* x = reinterpret_cast<const char*>(x_addr);
  const void* w = reinterpret_cast<const void*>(w_addr);
  char* y = reinterpret_cast<char*>(y_addr);
  const float e = float(eps);
  py::gil_scoped_release release;
  const int T = team_size(threads, std::min(M, M * N / kMinValuesPerThread));
  run_team(T, [&](int t) {
    for (int64_t m = M * t / T; m < M * (t + 1) / T; ++m)
      row(x + size_t(m * ldx) * width, w, y + size_t(m * N) * width, N, e, bf16);
  });
}

}  // namespace rms_norm_detail
}  // namespace ragfast

RAGFAST_REGISTER(rms_norm, [](py::module_& m) {
  using namespace ragfast::rms_norm_detail;
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("ldx"), py::arg("w"), py::arg("y"), py::arg("M"), py::arg("N"),
        py::arg("eps"), py::arg("bf16"), py::arg("threads") = 0,
        "rms_norm(x, ldx, w, y, M, N, eps, bf16, threads=0)\n"
        "y[m, :N] (rows N apart) = w * (x[m] / sqrt(mean(x[m]^2) + eps)) for rows ldx elements apart, fp32 or\n"
        "bf16 (the input's dtype after the scaling and after the weight, as transformers' RMSNorm). Use\n"
        "ragfast.ops.rms_norm.rms_norm, which checks the tensors; this does not.");
});
