#include "cpu/host_backend.h"

#include <cstdlib>
#include <cstring>

namespace memo::cpu {

void* HostBackend::raw_alloc(std::size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, core::kSegmentAlignment, bytes) != 0) return nullptr;
  return p;
}

void HostBackend::raw_free(void* ptr, std::size_t /*bytes*/) { std::free(ptr); }

void HostBackend::fill(void* ptr, std::size_t bytes, unsigned char byte) { std::memset(ptr, byte, bytes); }

HostBackend& host_backend() {
  static HostBackend backend;
  return backend;
}

}  // namespace memo::cpu
