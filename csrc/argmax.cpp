// argmax: the index of the largest value of each row, as greedy decoding picks its next token.
//
// A decode step over 64 rows ends in one argmax over a [64, 151936] logits block (Qwen2.5's
// vocabulary). torch's argmax took 17 ms of a 285 ms bf16 step there (2 threads, AMD EPYC Zen 4):
// its bf16 reduction is not vectorised, and the block is only 19 MB. These kernels read each row
// twice, both passes from cache: its largest value (a vector max, NaNs noted on the way), then the
// first position equal to it. Threads split the rows.
//
// The per-ISA row kernels live in csrc/isa/argmax_<level>.cpp; this file holds the portable one,
// the dispatcher and the binding, which takes addresses (python/ragfast/ops/argmax.py checks the
// tensors and keeps them alive).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "argmax_common.h"
#include "bf16_scalar.h"
#include "isa.h"
#include "registry.h"
#include "threads.h"

namespace py = pybind11;

namespace ragfast {
namespace argmax_detail {

using namespace ragfast::argmax_common;

// Values per thread below which one thread does it all (a 2-thread team costs a few
// microseconds, about what 16k values take).
constexpr int64_t kMinValuesPerThread = 1 << 15;

int64_t argmax_row_generic(const void* row, int64_t n, bool bf16) {
  int64_t best = 0;
  float m = load_float(row, 0, bf16);
  if (std::isnan(m)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = load_float(row, i, bf16);
    if (std::isnan(v)) return i;
    if (v > m) {
      m = v;
      best = i;
    }
  }
  return best;
}

// The row kernel of the ISA level in use (csrc/isa.cpp); every level from avx512 up runs the
// AVX-512 one (their extra instructions add nothing a maximum and a compare need).
RowFn pick_row() {
  const int level = isa::current();
#ifdef RAGFAST_ISA_HAVE_avx512
  if (level >= isa::kAvx512) return &argmax_row_avx512;
#endif
#ifdef RAGFAST_ISA_HAVE_avx2
  if (level >= isa::kAvx2) return &argmax_row_avx2;
#endif
  (void)level;
  return &argmax_row_generic;
}

void argmax(uintptr_t x_addr, bool bf16, int64_t M, int64_t N, int64_t ldx, uintptr_t out_addr, int threads) {
  if (M < 0 || N < 1) throw std::invalid_argument("argmax: rows must be >= 0 and each row non-empty");
  if (M > 1 && ldx < N) throw std::invalid_argument("argmax: the row stride is shorter than the row");
  if (M == 0) return;
  const RowFn row = pick_row();
  const size_t width = bf16 ? 2 : 4;
  const char* x = reinterpret_cast<const char*>(x_addr);
  auto* out = reinterpret_cast<int64_t*>(out_addr);
  py::gil_scoped_release release;
  const int T = team_size(threads, std::min(M, M * N / kMinValuesPerThread));
  run_team(T, [&](int t) {
    for (int64_t m = M * t / T; m < M * (t + 1) / T; ++m) out[m] = row(x + size_t(m * ldx) * width, N, bf16);
  });
}

}  // namespace argmax_detail
}  // namespace ragfast

RAGFAST_REGISTER(argmax, [](py::module_& m) {
  using namespace ragfast::argmax_detail;
  m.def("argmax", &argmax, py::arg("x"), py::arg("bf16"), py::arg("M"), py::arg("N"), py::arg("ldx"),
        py::arg("out"), py::arg("threads") = 0,
        "argmax(x, bf16, M, N, ldx, out, threads=0)\n"
        "out[m] (int64) = the first index of the largest of x[m, :N] (rows ldx elements apart, fp32 or\n"
        "bf16), as torch.argmax: a NaN counts as largest. Use ragfast.ops.argmax.argmax, which checks\n"
        "the tensors; this does not.");
});
