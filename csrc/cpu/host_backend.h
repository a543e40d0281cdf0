// Host memory backend for the core allocators (aligned malloc).
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

// Process-lifetime backend shared by every host-side allocator.
HostBackend& host_backend();

}  // namespace memo::cpu
