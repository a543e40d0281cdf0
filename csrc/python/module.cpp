// The memo._C module: build information plus every registered component.
// Only pybind11 and torch's version macro: torch/extension.h would add a
// heavy translation unit to every build for nothing used here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/headeronly/version.h>

#include <string>
#include <utility>
#include <vector>

#include "python/registry.h"

namespace memo::python {

namespace {
std::vector<std::pair<std::string, Binder>>& binders() {
  static std::vector<std::pair<std::string, Binder>> list;
  return list;
}

std::string compiler() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return "gcc " + std::to_string(__GNUC__) + "." + std::to_string(__GNUC_MINOR__) + "." +
         std::to_string(__GNUC_PATCHLEVEL__);
#else
  return "unknown";
#endif
}
}  // namespace

int register_binder(const char* name, Binder binder) {
  binders().emplace_back(name, binder);
  return 0;
}

}  // namespace memo::python

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace memo::python;
  m.doc() = "memo native core: planned allocator, rounding buffers, CPU and CUDA backends";
  std::vector<std::string> components;
  for (auto& [name, bind] : binders()) {
    bind(m);
    components.push_back(name);
  }
  m.def(
      "build_info",
      [components]() {
        pybind11::dict info;
        pybind11::list backends;
        backends.append("cpu");
#ifdef MEMO_WITH_CUDA_BACKEND
        backends.append("cuda");
#endif
        info["version"] = MEMO_VERSION;
        info["backends"] = backends;
        info["cuda_version"] = MEMO_CUDA_VERSION;
        info["compiler"] = compiler();
        info["cxx_standard"] = static_cast<long>(__cplusplus);
        info["torch_version"] = TORCH_VERSION;
        info["components"] = components;
        return info;
      },
      "What this extension was built with: backends, CUDA version, compiler, torch, components.");
}
