// The CPU backend: PyTorch's CPU tensor allocations go through memo's
// planned allocator (the C API's CPU device allocator) while it is installed.
#pragma once

namespace memo::cpu {

// Makes memo's allocator c10's CPU allocator; AllocatorError when already installed.
void install_cpu_allocator();
// Restores the allocator that install replaced; AllocatorError when not installed.
void uninstall_cpu_allocator();
bool cpu_allocator_installed();

}  // namespace memo::cpu
