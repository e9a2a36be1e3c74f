// The extension module ragfast._C: runs every op's registration and reports how it was built.
#include "registry.h"
#ifdef RAGFAST_OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

static py::dict build_info() {
  py::dict d;
#ifdef RAGFAST_OPENMP
  d["openmp"] = true;
  d["max_threads"] = omp_get_max_threads();
#else
  d["openmp"] = false;
  d["max_threads"] = 1;
#endif
  py::list isa;
#ifdef __AVX2__
  isa.append("avx2");
#endif
#ifdef __FMA__
  isa.append("fma");
#endif
#ifdef __AVX512F__
  isa.append("avx512f");
#endif
#ifdef __AVX512BW__
  isa.append("avx512bw");
#endif
#ifdef __AVX512VNNI__
  isa.append("avx512vnni");
#endif
#ifdef __AVX512BF16__
  isa.append("avx512bf16");
#endif
#ifdef __ARM_NEON
  isa.append("neon");
#endif
  d["isa"] = isa;
#ifdef RAGFAST_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
  py::list ops;
  for (auto& kv : ragfast::binders()) ops.append(kv.first);
  d["ops"] = ops;
  return d;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "ragfast compiled CPU kernels (pybind11, OpenMP)";
  m.def("build_info", &build_info, "How the extension was built: OpenMP, ISA extensions, ops.");
  for (auto& kv : ragfast::binders()) kv.second(m);
}
