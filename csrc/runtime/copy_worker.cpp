// See NOTE [CPU copy worker] in copy_worker.h.
#include "runtime/copy_worker.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <utility>

namespace memo::runtime {

CopyWorker::CopyWorker(std::string name, uint64_t max_delay_us, uint64_t seed)
    : name_(std::move(name)), max_delay_us_(max_delay_us), rng_(seed) {
  thread_ = std::thread([this] { run(); });
}

CopyWorker::~CopyWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t CopyWorker::submit(void* dst, const void* src, size_t nbytes, CopyWorker* dep_worker,
                            uint64_t dep_ticket) {
  if (dep_worker == this) {
    // Same queue: FIFO order already guarantees the dependency.
    dep_worker = nullptr;
  }
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw std::runtime_error("memo.rounding: copy worker '" + name_ + "' is stopped");
    ticket = next_ticket_++;
    queue_.push_back(Job{ticket, dst, src, nbytes, dep_worker, dep_ticket});
  }
  cv_work_.notify_one();
  return ticket;
}

uint64_t CopyWorker::wait(uint64_t ticket) {
  auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  if (ticket >= next_ticket_) {
    throw std::runtime_error("memo.rounding: wait on ticket " + std::to_string(ticket) +
                             " that worker '" + name_ + "' never issued");
  }
  cv_done_.wait(lock, [&] { return completed_ >= ticket; });
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
}

bool CopyWorker::query(uint64_t ticket) const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_ >= ticket;
}

void CopyWorker::synchronize() {
  uint64_t last;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last = next_ticket_ - 1;
  }
  wait(last);
}

void CopyWorker::set_max_delay_us(uint64_t us) {
  std::lock_guard<std::mutex> lock(mu_);
  max_delay_us_ = us;
}

uint64_t CopyWorker::max_delay_us() const {
  std::lock_guard<std::mutex> lock(mu_);
  return max_delay_us_;
}

uint64_t CopyWorker::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

uint64_t CopyWorker::submitted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_ticket_ - 1;
}

uint64_t CopyWorker::bytes_copied() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_copied_;
}

void CopyWorker::run() {
  for (;;) {
    Job job;
    uint64_t delay_us = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      job = queue_.front();
      if (max_delay_us_ > 0) {
        delay_us = std::uniform_int_distribution<uint64_t>(0, max_delay_us_)(rng_);
      }
    }
    if (job.dep_worker != nullptr) job.dep_worker->wait(job.dep_ticket);
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    if (job.nbytes > 0) std::memcpy(job.dst, job.src, job.nbytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.pop_front();
      completed_ = job.ticket;
      bytes_copied_ += job.nbytes;
    }
    cv_done_.notify_all();
  }
}

HostArena::HostArena(size_t nbytes) : nbytes_(nbytes) {
  if (nbytes == 0) return;
  constexpr size_t kAlign = 4096;
  size_t rounded = (nbytes + kAlign - 1) / kAlign * kAlign;
  if (posix_memalign(&data_, kAlign, rounded) != 0 || data_ == nullptr) {
    data_ = nullptr;
    throw std::bad_alloc();
  }
  // Touch every page so the memory is committed now, not at the first offload.
  std::memset(data_, 0, rounded);
}

HostArena::~HostArena() { std::free(data_); }

}  // namespace memo::runtime
