// One registration hook per op file, so each csrc/<op>.cpp binds itself and bindings.cpp never
// needs to know the list: add a file, it is globbed by CMake and appears in ragfast._C.
#pragma once
#include <pybind11/pybind11.h>
#include <functional>
#include <string>
#include <vector>

namespace ragfast {

using Binder = std::function<void(pybind11::module_&)>;

// Function-local static: safe against static-initialisation order across translation units.
inline std::vector<std::pair<std::string, Binder>>& binders() {
  static std::vector<std::pair<std::string, Binder>> list;
  return list;
}

struct Registrar {
  Registrar(const char* name, Binder fn) { binders().emplace_back(name, std::move(fn)); }
};

}  // namespace ragfast

#define RAGFAST_CONCAT_(a, b) a##b
#define RAGFAST_CONCAT(a, b) RAGFAST_CONCAT_(a, b)
// Usage in csrc/<op>.cpp:  RAGFAST_REGISTER(topk_ip, [](pybind11::module_& m) { m.def(...); });
#define RAGFAST_REGISTER(name, fn) \
  static ::ragfast::Registrar RAGFAST_CONCAT(ragfast_registrar_, name)(#name, fn)
