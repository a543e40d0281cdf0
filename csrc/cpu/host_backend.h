// Host memory backend for the core allocators (aligned malloc): the CPU
// backend kind of the C API (NOTE [One allocator C API] in core/allocator_api.h).
#pragma once

#include "core/alloc_backend.h"

namespace memo::cpu {

class HostBackend final : public core::RawBackend {
 public:
  void* raw_alloc(std::size_t bytes) override;
  void raw_free(void* ptr, std::size_t bytes) override;
  void fill(void* ptr, std::size_t bytes, unsigned char byte) override;
  const char* name() const override { return "cpu"; }
};

}  // namespace memo::cpu
