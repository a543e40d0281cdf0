#include "cpu/host_backend.h"

#include <cstdlib>
#include <cstring>
#include <memory>

#include "core/allocator_api.h"

namespace memo::cpu {

void* HostBackend::raw_alloc(std::size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, core::kSegmentAlignment, bytes) != 0) return nullptr;
  return p;
}

void HostBackend::raw_free(void* ptr, std::size_t /*bytes*/) { std::free(ptr); }

void HostBackend::fill(void* ptr, std::size_t bytes, unsigned char byte) { std::memset(ptr, byte, bytes); }

}  // namespace memo::cpu

namespace memo::core {

// memo._C holds the CPU backend (NOTE [One allocator C API]); host memory has one device.
std::unique_ptr<RawBackend> make_backend(int kind, int /*device*/) {
  if (kind != MEMO_BACKEND_CPU) return nullptr;
  return std::make_unique<cpu::HostBackend>();
}

}  // namespace memo::core
