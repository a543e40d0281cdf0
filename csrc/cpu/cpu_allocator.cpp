// NOTE [CPU allocator interception]
// c10::SetCPUAllocator(alloc, priority) replaces the allocator behind every
// CPU tensor (empty_cpu asks c10::GetCPUAllocator()). It only overwrites when
// `priority` is >= the stored one, and there is no getter for the stored
// priority, so install and restore both use the maximum (255). Restoring puts
// back the exact allocator object install found. Each DataPtr carries its own
// deleter, so tensors made before the swap free through the old allocator
// and tensors made while memo was installed free through memo's deleter,
// also after uninstall; that is why the allocator behind them is the C API's
// CPU device allocator, a process-lifetime object that is never destroyed
// (its arena is released by NOTE [Arena lifetime]).
#include "cpu/cpu_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <mutex>

#include "core/alloc_backend.h"
#include "core/allocator_api.h"

namespace memo::cpu {

namespace {

constexpr std::uint8_t kMaxPriority = 255;

// The allocator behind PyTorch's CPU allocations (NOTE [One allocator C API]).
memo_alloc* cpu_device_allocator() {
  static memo_alloc* alloc = memo_alloc_device(MEMO_BACKEND_CPU, 0);
  TORCH_CHECK(alloc != nullptr, memo_alloc_last_error());
  return alloc;
}

void delete_planned(void* ptr) { memo_alloc_free(cpu_device_allocator(), ptr); }

class CpuPlannedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t n) override {
    const c10::Device device(c10::DeviceType::CPU);
    void* p = nullptr;
    const int status = memo_alloc_malloc(cpu_device_allocator(), n, core::kDefaultStream, &p);
    if (status == MEMO_OUT_OF_MEMORY) C10_THROW_ERROR(OutOfMemoryError, memo_alloc_last_error());
    TORCH_CHECK(status == MEMO_OK, memo_alloc_last_error());
    return {p, p, &delete_planned, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_planned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CpuPlannedAllocator& c10_allocator() {
  static CpuPlannedAllocator alloc;
  return alloc;
}

std::mutex install_mutex;
c10::Allocator* previous = nullptr;

}  // namespace

void install_cpu_allocator() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (previous != nullptr)
    throw core::AllocatorError("memo allocator: the CPU allocator is already installed (contexts do not nest)");
  c10::Allocator* current = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&c10_allocator(), kMaxPriority);
  if (c10::GetCPUAllocator() != &c10_allocator())
    throw core::AllocatorError("memo allocator: c10 refused to switch the CPU allocator");
  previous = current;
}

void uninstall_cpu_allocator() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (previous == nullptr) throw core::AllocatorError("memo allocator: the CPU allocator is not installed");
  c10::SetCPUAllocator(previous, kMaxPriority);
  previous = nullptr;
}

bool cpu_allocator_installed() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return previous != nullptr;
}

}  // namespace memo::cpu
