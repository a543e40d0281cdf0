// Binding registry: each component of memo._C registers its own pybind11
// bindings from its own file, so adding a component never edits a shared list.
//
//   static void bind_allocator(pybind11::module_& m) { ... }
//   MEMO_REGISTER_BINDINGS(allocator, bind_allocator)
#pragma once

#include <pybind11/pybind11.h>

namespace memo::python {

using Binder = void (*)(pybind11::module_&);

// Returns a dummy value so it can initialise a static; called before PyInit.
int register_binder(const char* name, Binder binder);

}  // namespace memo::python

#define MEMO_REGISTER_BINDINGS(name, fn) \
  static const int memo_binder_registered_##name = ::memo::python::register_binder(#name, fn);
