// The extension module ragfast._C: runs every op's registration and reports how it was built.
#include "registry.h"
#include "isa.h"

#include <pybind11/stl.h>
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
  // ISA levels whose kernels this build carries (each in its own translation unit), and
  // whether the baseline code was built for the build machine (RAGFAST_NATIVE).
  py::list isa;
  for (int l = 0; l < ragfast::isa::kNumLevels; ++l)
    if (ragfast::isa::compiled(l)) isa.append(ragfast::isa::name(l));
  d["isa"] = isa;
#ifdef RAGFAST_NATIVE_BUILD
  d["native"] = true;
#else
  d["native"] = false;
#endif
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

// Which ISA levels are compiled in, which this CPU runs, which one ops use and why.
static py::dict isa_info() {
  py::dict d;
  py::list compiled, supported;
  py::dict missing;
  for (int l = 0; l < ragfast::isa::kNumLevels; ++l) {
    if (!ragfast::isa::compiled(l)) continue;
    compiled.append(ragfast::isa::name(l));
    const auto miss = ragfast::isa::missing(l);
    if (miss.empty()) supported.append(ragfast::isa::name(l));
    else missing[ragfast::isa::name(l)] = miss;
  }
  d["compiled"] = compiled;
  d["supported"] = supported;
  d["missing"] = missing;
  d["cpu"] = ragfast::isa::cpu_features();
  d["reason"] = ragfast::isa::reason();
  try {
    d["chosen"] = ragfast::isa::name(ragfast::isa::current());
    d["error"] = py::none();
  } catch (const std::exception& e) {
    d["chosen"] = py::none();
    d["error"] = e.what();
  }
  return d;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "ragfast compiled CPU kernels (pybind11, OpenMP)";
  m.def("build_info", &build_info, "How the extension was built: OpenMP, ISA extensions, ops.");
  m.def("isa_info", &isa_info,
        "ISA levels: compiled (in this build), supported (by this CPU), missing (features per level), cpu,\n"
        "chosen (the level ops run at; None when RAGFAST_ISA is refused), reason, error.");
  m.def("isa_current", []() { return std::string(ragfast::isa::name(ragfast::isa::current())); },
        "The ISA level ops run at (cheap). Raises RuntimeError when RAGFAST_ISA is refused.");
  std::string levels;
  for (int l = 0; l < ragfast::isa::kNumLevels; ++l) levels += std::string("'") + ragfast::isa::name(l) + "', ";
  m.def("set_isa", [](const std::string& level) { return std::string(ragfast::isa::name(ragfast::isa::set_current(level))); },
        py::arg("level"),
        ("Switch the ISA level at runtime (" + levels + "or 'auto'); returns the\n"
         "level now in use. Raises ValueError for a level not compiled in or that this CPU cannot run.").c_str());
  for (auto& kv : ragfast::binders()) kv.second(m);
}
