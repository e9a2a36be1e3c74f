// Policy kernels: first-crossing sweeps over STOP-score matrices, and paired-bootstrap means.
//
// Both are embarrassingly parallel over rows (trajectories) or resamples. The bootstrap draws
// its resample indices from a counter-based generator keyed by (seed, resample), so a seed
// gives the same numbers on 1 thread or 64.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "isa.h"
#include "policy_common.h"
#include "registry.h"


namespace py = pybind11;

namespace ragfast {
namespace policy_detail {

// Work (in inner-loop steps) below which OpenMP threads cost more than they save: on busy
// shared cores a 2-thread team took 57 ms for a sweep one thread finishes in 0.7 ms.
static constexpr int64_t kParallelWork = int64_t(1) << 22;


// Output buffer: the caller's (C-contiguous, exact shape and dtype; lets tests poison it) or a
// fresh one.
template <typename T>
py::array_t<T> take_out(const py::object& out, std::vector<py::ssize_t> shape, const char* what) {
  if (out.is_none()) return py::array_t<T>(shape);
  if (!py::isinstance<py::array_t<T, 0>>(out))
    throw std::invalid_argument(std::string(what) + ": out has the wrong dtype");
  auto a = py::reinterpret_borrow<py::array_t<T, 0>>(out);
  if (!(a.flags() & py::array::c_style) || !a.writeable())
    throw std::invalid_argument(std::string(what) + ": out must be a writeable C-contiguous array");
  if (a.ndim() != static_cast<py::ssize_t>(shape.size()))
    throw std::invalid_argument(std::string(what) + ": out has the wrong number of dimensions");
  for (size_t i = 0; i < shape.size(); ++i)
    if (a.shape(i) != shape[i]) throw std::invalid_argument(std::string(what) + ": out has the wrong shape");
  return a;
}

// ---------------------------------------------------------------------------------------------
// sweep_first_crossing
//
// For row b the first crossing of threshold h is the first t < lengths[b] with
// scores[b, t] >= h. NaN scores never cross. Because "some s_u >= h for u <= t" equals
// "prefix_max(t) >= h", the predicate is monotone in t once NaNs are skipped, so each
// threshold is a binary search over the row's prefix maximum: O(T + M log T) per row instead
// of O(T * M).
template <typename Scalar>
py::array_t<int64_t> sweep_first_crossing(py::array_t<Scalar, 0> scores, py::array_t<int64_t, 0> lengths,
                                          py::array_t<double, 0> thresholds, py::object out_arg) {
  if (scores.ndim() != 2) throw std::invalid_argument("sweep_first_crossing: scores must be 2-D [B, T], got ndim=" +
                                                      std::to_string(scores.ndim()));
  if (lengths.ndim() != 1) throw std::invalid_argument("sweep_first_crossing: lengths must be 1-D [B]");
  if (thresholds.ndim() != 1) throw std::invalid_argument("sweep_first_crossing: thresholds must be 1-D [M]");
  const int64_t B = scores.shape(0), T = scores.shape(1), M = thresholds.shape(0);
  if (lengths.shape(0) != B)
    throw std::invalid_argument("sweep_first_crossing: lengths has " + std::to_string(lengths.shape(0)) +
                                " entries for " + std::to_string(B) + " rows");
  auto S = scores.template unchecked<2>();
  auto L = lengths.template unchecked<1>();
  auto H = thresholds.template unchecked<1>();
  for (int64_t b = 0; b < B; ++b) {
    if (L(b) < 0 || L(b) > T)
      throw std::invalid_argument("sweep_first_crossing: lengths[" + std::to_string(b) + "]=" +
                                  std::to_string(L(b)) + " is outside [0, " + std::to_string(T) + "]");
  }
  py::array_t<int64_t> out = take_out<int64_t>(out_arg, {B, M}, "sweep_first_crossing");
  int64_t* O = out.mutable_data();
  const bool par = B * (T + M) > kParallelWork;
  {
    py::gil_scoped_release release;
#pragma omp parallel if (par)
    {
      std::vector<double> pm(static_cast<size_t>(T > 0 ? T : 1));
#pragma omp for schedule(static)
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = L(b);
        double run = std::nan("");
        for (int64_t t = 0; t < n; ++t) {
          const double s = static_cast<double>(S(b, t));
          if (!std::isnan(s)) run = std::isnan(run) ? s : (s > run ? s : run);
          pm[t] = run;  // NaN until the first scorable state: compares false, keeps monotonicity
        }
        int64_t* ob = O + b * M;
        for (int64_t m = 0; m < M; ++m) {
          const double h = H(m);
          // pm[n-1] is the row maximum; below h (or NaN, or empty row) means never.
          if (n == 0 || !(pm[n - 1] >= h)) {
            ob[m] = -1;
            continue;
          }
          int64_t lo = 0, hi = n - 1;  // invariant: pm[hi] >= h
          while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (pm[mid] >= h) hi = mid; else lo = mid + 1;
          }
          ob[m] = lo;
        }
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// bootstrap_means
//
// splitmix64's output function used as a counter-based hash: the index of draw i of resample
// r is a pure function of (seed, r, i). Draws map to [0, n) by a 64x64->128 multiply-high
// (bias at most n / 2^64, far below any resampling error).
static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
static constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

static inline uint64_t bounded(uint64_t z, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(z) * n) >> 64);
}

// Micro-tile of the resample-mean product (see policy_common.h), portable version.
using policy_common::kKT;
using policy_common::kRB;

static void tile_kernel(const double* CT, const double* DT, int64_t n, int64_t Kp, int64_t k0,
                               double* acc /* [kKT][kRB] */) {
  for (int64_t t = 0; t < kKT * kRB; ++t) acc[t] = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double* c = CT + i * kRB;
    const double* d = DT + i * Kp + k0;
    for (int64_t kk = 0; kk < kKT; ++kk)
      for (int64_t j = 0; j < kRB; ++j) acc[kk * kRB + j] += d[kk] * c[j];
  }
}

// The tile kernel of the ISA level in use (csrc/isa.cpp): AVX-512 / AVX2 builds live in their
// own translation units (csrc/isa/policy_<level>.cpp); this file holds the portable one.
using TileFn = void (*)(const double*, const double*, int64_t, int64_t, int64_t, double*);
TileFn pick_tile_kernel() {
  // Levels are ordered (csrc/isa_levels.h): every level from avx512 up runs the AVX-512 tile
  // (no BF16 / VNNI / AMX tile kernel for doubles), so a new level needs nothing here.
  const int level = isa::current();
#ifdef RAGFAST_ISA_HAVE_avx512
  if (level >= isa::kAvx512) return &policy_common::tile_kernel_avx512;
#endif
#ifdef RAGFAST_ISA_HAVE_avx2
  if (level >= isa::kAvx2) return &policy_common::tile_kernel_avx2;
#endif
  (void)level;
  return &tile_kernel;
}

// diffs: [K, n] (any strides) or [n]. Every row is resampled with the SAME question indices in
// a given resample, so the K comparisons (e.g. one per threshold) stay paired with each other.
// Blocks of 8 resamples: draw their indices into per-question counts (laid out [n][8]), then
// multiply by the rows of D as a register-tiled GEMM. The earlier per-resample scatter-add
// (count * column of a [n, K] copy) re-read D from L2 once per resample and ran 3-5x slower.
py::array_t<double> bootstrap_means(py::array_t<double, 0> diffs, int64_t n_resamples, uint64_t seed,
                                    py::object out_arg) {
  if (diffs.ndim() != 1 && diffs.ndim() != 2)
    throw std::invalid_argument("bootstrap_means: diffs must be 1-D [n] or 2-D [K, n], got ndim=" +
                                std::to_string(diffs.ndim()));
  if (n_resamples < 1) throw std::invalid_argument("bootstrap_means: n_resamples must be >= 1");
  const bool one = diffs.ndim() == 1;
  const int64_t K = one ? 1 : diffs.shape(0);
  const int64_t n = one ? diffs.shape(0) : diffs.shape(1);
  if (n < 1) throw std::invalid_argument("bootstrap_means: need at least one question (n >= 1)");
  const int64_t Kp = ((K + kKT - 1) / kKT) * kKT;
  // Transposed, zero-padded copy [n, Kp]: a tile's 12 values for question i are adjacent.
  std::vector<double> DT(static_cast<size_t>(n * Kp), 0.0);
  {
    const char* base = reinterpret_cast<const char*>(diffs.data());
    const py::ssize_t s0 = diffs.strides(0);
    const py::ssize_t s1 = one ? 0 : diffs.strides(1);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < n; ++i) {
        const char* p = one ? base + i * s0 : base + k * s0 + i * s1;
        DT[i * Kp + k] = *reinterpret_cast<const double*>(p);
      }
  }
  py::array_t<double> out =
      one ? take_out<double>(out_arg, {n_resamples}, "bootstrap_means")
          : take_out<double>(out_arg, {K, n_resamples}, "bootstrap_means");
  double* O = out.mutable_data();
  const double inv_n = 1.0 / static_cast<double>(n);
  const uint64_t key = mix64(seed + kGolden);
  const int64_t nblocks = (n_resamples + kRB - 1) / kRB;
  const bool par = nblocks > 1 && n * Kp * n_resamples > kParallelWork;
  const TileFn tile = pick_tile_kernel();
  {
    py::gil_scoped_release release;
#pragma omp parallel if (par)
    {
      std::vector<double> CT(static_cast<size_t>(n * kRB));
      double acc[kKT * kRB];
#pragma omp for schedule(static)
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        const int64_t r0 = blk * kRB;
        const int64_t nr = std::min<int64_t>(kRB, n_resamples - r0);
        std::fill(CT.begin(), CT.end(), 0.0);
        for (int64_t j = 0; j < nr; ++j) {
          const uint64_t r = static_cast<uint64_t>(r0 + j);
          const uint64_t rk = mix64(key ^ mix64(r * kGolden + 0x632be59bd9b4e019ULL));
          for (int64_t i = 0; i < n; ++i) {
            const uint64_t z = mix64(rk + static_cast<uint64_t>(i + 1) * kGolden);
            CT[bounded(z, static_cast<uint64_t>(n)) * kRB + j] += 1.0;
          }
        }
        for (int64_t k0 = 0; k0 < Kp; k0 += kKT) {
          tile(CT.data(), DT.data(), n, Kp, k0, acc);
          const int64_t kend = std::min<int64_t>(kKT, K - k0);
          for (int64_t kk = 0; kk < kend; ++kk)
            for (int64_t j = 0; j < nr; ++j) O[(k0 + kk) * n_resamples + r0 + j] = acc[kk * kRB + j] * inv_n;
        }
      }
    }
  }
  return out;
}

}  // namespace policy_detail
}  // namespace ragfast

RAGFAST_REGISTER(policy, [](py::module_& m) {
  using namespace ragfast::policy_detail;
  const char* sweep_doc =
      "sweep_first_crossing(scores[B,T] float32|float64, lengths[B] int64, thresholds[M] float64, out=None) -> int64[B,M]\n"
      "First t < lengths[b] with scores[b,t] >= thresholds[m]; -1 where never. NaN never crosses.";
  m.def("sweep_first_crossing", &sweep_first_crossing<float>, py::arg("scores").noconvert(),
        py::arg("lengths").noconvert(), py::arg("thresholds").noconvert(), py::arg("out") = py::none(), sweep_doc);
  m.def("sweep_first_crossing", &sweep_first_crossing<double>, py::arg("scores").noconvert(),
        py::arg("lengths").noconvert(), py::arg("thresholds").noconvert(), py::arg("out") = py::none(), sweep_doc);
  m.def("bootstrap_means", &bootstrap_means, py::arg("diffs").noconvert(), py::arg("n_resamples"),
        py::arg("seed"), py::arg("out") = py::none(),
        "bootstrap_means(diffs[n] or [K,n] float64, n_resamples, seed, out=None) -> float64[n_resamples] or [K,n_resamples]\n"
        "Means of paired resamples of the questions (the same indices for every row), drawn from a\n"
        "counter-based generator: deterministic for a seed whatever the thread count.");
});
