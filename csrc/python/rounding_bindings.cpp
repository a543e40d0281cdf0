// Python glue for the rounding-buffer CPU backend (memo._C.rounding). Validates
// tensors and hands raw pointers to the torch-independent core in copy_worker.h.
// Not <torch/extension.h>: it pulls in all of libtorch's C++ API (nn, optim, ...), which makes this
// the slowest file to build; the tensor caster and from_blob are all this file needs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <new>
#include <string>

#include "python/registry.h"
#include "runtime/copy_worker.h"

namespace py = pybind11;

namespace memo::runtime {
namespace {

void check_copy(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(),
              "memo.rounding: the CPU copy worker copies CPU tensors; got ", dst.device(), " <- ",
              src.device());
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(),
              "memo.rounding: copy worker tensors must be contiguous");
  TORCH_CHECK(dst.nbytes() == src.nbytes(), "memo.rounding: copy of ", src.nbytes(),
              " bytes into a destination of ", dst.nbytes(), " bytes");
}

at::Tensor arena_tensor(const std::shared_ptr<HostArena>& arena) {
  // The tensor's deleter owns a reference (its captured shared_ptr), so the arena lives as long as any
  // view of it and goes with the storage.
  return at::from_blob(
      arena->data(), {static_cast<int64_t>(arena->nbytes())},
      [keep = arena](void*) mutable { keep.reset(); }, at::TensorOptions().dtype(at::kByte));
}

void bind_rounding(py::module_& m) {
  auto r = m.def_submodule("rounding", "Rounding buffers, CPU backend: copy workers and host arena");

  py::class_<CopyWorker, std::shared_ptr<CopyWorker>>(r, "CopyWorker",
                                                      "An asynchronous memcpy thread with a FIFO "
                                                      "queue; tickets play the role of CUDA events.")
      .def(py::init<std::string, uint64_t, uint64_t>(), py::arg("name"), py::arg("max_delay_us") = 0,
           py::arg("seed") = 0)
      .def(
          "submit",
          [](CopyWorker& self, const at::Tensor& dst, const at::Tensor& src,
             std::shared_ptr<CopyWorker> dep_worker, uint64_t dep_ticket) {
            check_copy(dst, src);
            return self.submit(dst.data_ptr(), src.data_ptr(), dst.nbytes(), dep_worker.get(),
                               dep_ticket);
          },
          py::arg("dst"), py::arg("src"), py::arg("dep_worker") = nullptr, py::arg("dep_ticket") = 0,
          "Queue dst.copy_(src) (same byte size, contiguous CPU tensors); the caller keeps both "
          "alive until the returned ticket completes. Optionally start only after dep_worker "
          "completed dep_ticket.")
      .def("wait", &CopyWorker::wait, py::arg("ticket"), py::call_guard<py::gil_scoped_release>(),
           "Block until the ticket is done; returns the nanoseconds waited.")
      .def("query", &CopyWorker::query, py::arg("ticket"))
      .def("synchronize", &CopyWorker::synchronize, py::call_guard<py::gil_scoped_release>())
      .def_property("max_delay_us", &CopyWorker::max_delay_us, &CopyWorker::set_max_delay_us)
      .def_property_readonly("completed", &CopyWorker::completed)
      .def_property_readonly("submitted", &CopyWorker::submitted)
      .def_property_readonly("bytes_copied", &CopyWorker::bytes_copied)
      .def_property_readonly("name", &CopyWorker::name);

  r.def(
      "host_arena",
      [](uint64_t nbytes) {
        std::shared_ptr<HostArena> arena;
        try {
          arena = std::make_shared<HostArena>(static_cast<size_t>(nbytes));
        } catch (const std::bad_alloc&) {
          throw py::value_error("memo.rounding: could not allocate a host arena of " +
                                std::to_string(nbytes) + " bytes");
        }
        return arena_tensor(arena);
      },
      py::arg("nbytes"),
      "Allocate the host arena (page-aligned, every page touched) as a uint8 CPU tensor.");
}

}  // namespace
}  // namespace memo::runtime

MEMO_REGISTER_BINDINGS(rounding, memo::runtime::bind_rounding)
