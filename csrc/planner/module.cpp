// memo._planner_native: the planner's own native module, pybind11 glue for the
// exact DSA search's depth-first run (core/dsa_search.h). It takes
// planner/search.py's numpy arrays, checks their shapes, and runs the search
// with the GIL released.
//
// NOTE [A torch-free planner module]
// The planner is the lowest layer (planner <- profiler <- pipeline <- runtime):
// `import memo.planner` must work, and make plans, where torch is not
// installed. So this module is built by setup.py as a plain setuptools
// extension from this file and core/dsa_*.cpp only, against the pybind11
// package's headers; it links no libtorch, and memo._C (which does) holds no
// planner binding: one binding of the search, here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/dsa_greedy.h"
#include "core/dsa_search.h"

namespace py = pybind11;

namespace memo::python {

namespace {

using Int64Array = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;

std::vector<std::int64_t> to_vector(const Int64Array& a, const char* name) {
  if (a.ndim() != 1)
    throw std::invalid_argument(std::string("memo.planner.search: ") + name + " must be 1-D, got " +
                                std::to_string(a.ndim()) + " dimensions");
  return std::vector<std::int64_t>(a.data(), a.data() + a.shape(0));
}

// A run's node limit: None for none (-1 in the core), else a count >= 0.
std::int64_t node_limit_of(const std::optional<std::int64_t>& node_limit) {
  if (node_limit && *node_limit < 0)
    throw std::invalid_argument("memo.planner.search: node_limit must be >= 0 or None, got " +
                                std::to_string(*node_limit));
  return node_limit.value_or(-1);
}

void bind_dsa_search(py::module_& m) {
  py::class_<core::DsaSearch>(m, "DsaSearch",
                              "The depth-first run of memo.planner.search over one instance's sections.")
      .def(py::init([](const Int64Array& size, const Int64Array& first, const Int64Array& last,
                       const Int64Array& by_section, const Int64Array& section_starts, const Int64Array& demand,
                       const Int64Array& neighbour_starts, const Int64Array& neighbour_items,
                       const Int64Array& length) {
             core::DsaInstance inst;
             inst.size = to_vector(size, "size");
             inst.first = to_vector(first, "first");
             inst.last = to_vector(last, "last");
             inst.by_section = to_vector(by_section, "by_section");
             inst.section_starts = to_vector(section_starts, "section_starts");
             inst.demand = to_vector(demand, "demand");
             inst.neighbour_starts = to_vector(neighbour_starts, "neighbour_starts");
             inst.neighbour_items = to_vector(neighbour_items, "neighbour_items");
             inst.length = to_vector(length, "length");
             return core::DsaSearch(std::move(inst));
           }),
           py::arg("size"), py::arg("first"), py::arg("last"), py::arg("by_section"), py::arg("section_starts"),
           py::arg("demand"), py::arg("neighbour_starts"), py::arg("neighbour_items"), py::arg("length"))
      .def(
          "run",
          [](const core::DsaSearch& search, std::int64_t capacity, const Int64Array& rank, double seconds,
             std::optional<std::int64_t> node_limit) {
            std::vector<std::int64_t> ranks = to_vector(rank, "rank");
            const std::int64_t limit = node_limit_of(node_limit);
            core::DsaOutcome out;
            {
              py::gil_scoped_release release;
              out = search.run(capacity, ranks, seconds, limit);
            }
            py::object offsets = out.found ? py::cast(out.offsets) : py::none();
            return py::make_tuple(offsets, out.exhausted, out.nodes);
          },
          py::arg("capacity"), py::arg("rank"), py::arg("seconds"), py::arg("node_limit"),
          "One run: (offsets or None, exhausted, nodes). seconds: the time left; node_limit: None for none.")
      .def(
          "run_by_offset",
          [](const core::DsaSearch& search, std::int64_t capacity, const Int64Array& rank, double seconds,
             std::optional<std::int64_t> node_limit, const std::string& keys) {
            std::vector<std::int64_t> ranks = to_vector(rank, "rank");
            const std::int64_t limit = node_limit_of(node_limit);
            core::DsaOutcome out;
            {
              py::gil_scoped_release release;
              out = search.run_by_offset(capacity, ranks, seconds, limit, keys);
            }
            py::object offsets = out.found ? py::cast(out.offsets) : py::none();
            return py::make_tuple(offsets, out.exhausted, out.nodes);
          },
          py::arg("capacity"), py::arg("rank"), py::arg("seconds"), py::arg("node_limit"), py::arg("keys") = "",
          "One offset-order run, as run: (offsets or None, exhausted, nodes). keys: how each part is ordered "
          "(letters of TWACZ: unplaced demand, lifetime length, area, sections, size; rank breaks ties).")
      .def_property_readonly("num_items", &core::DsaSearch::num_items)
      .def_property_readonly("num_sections", &core::DsaSearch::num_sections);
}

void bind_greedy(py::module_& m) {
  m.def(
      "greedy_place",
      [](const Int64Array& size, const Int64Array& start, const Int64Array& end, const Int64Array& order,
         double seconds, bool may_stop) {
        std::vector<std::int64_t> s = to_vector(size, "size"), b = to_vector(start, "start"),
                                  e = to_vector(end, "end"), o = to_vector(order, "order");
        core::GreedyPlacement out;
        {
          py::gil_scoped_release release;
          out = core::greedy_place(s, b, e, o, seconds, may_stop);
        }
        return py::make_tuple(out.offsets, out.peak, out.complete);
      },
      py::arg("size"), py::arg("start"), py::arg("end"), py::arg("order"), py::arg("seconds"), py::arg("may_stop"),
      "Best-fit greedy in `order` (NOTE [Greedy over an interval structure]): (offsets, peak, complete). "
      "With may_stop, stops unfinished (complete False, unplaced offsets -1) once `seconds` have passed.");
  m.def(
      "first_clash",
      [](const Int64Array& size, const Int64Array& start, const Int64Array& end, const Int64Array& offset) {
        std::vector<std::int64_t> s = to_vector(size, "size"), b = to_vector(start, "start"),
                                  e = to_vector(end, "end"), o = to_vector(offset, "offset");
        std::pair<std::int64_t, std::int64_t> clash;
        {
          py::gil_scoped_release release;
          clash = core::first_clash(s, b, e, o);
        }
        return py::make_tuple(clash.first, clash.second);
      },
      py::arg("size"), py::arg("start"), py::arg("end"), py::arg("offset"),
      "The first (earlier, later) pair of items overlapping in time and memory, (-1, -1) for none.");
}

}  // namespace

}  // namespace memo::python

PYBIND11_MODULE(_planner_native, m) {
  m.doc() = "memo.planner's native part: the exact DSA search's depth-first runs and the greedy (no torch)";
  memo::python::bind_dsa_search(m);
  memo::python::bind_greedy(m);
}
