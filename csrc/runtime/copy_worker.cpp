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

// Drains, then joins, before any member dies (NOTE [Copy worker lifetimes]).
CopyWorker::~CopyWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t CopyWorker::submit(void* dst, const void* src, size_t nbytes, const CopyWorker* dep_worker,
                            uint64_t dep_ticket) {
  // Same queue: FIFO order already guarantees the dependency. Another worker: hold its progress,
  // not the worker (NOTE [Copy worker lifetimes]).
  std::shared_ptr<Progress> dep;
  if (dep_worker != nullptr && dep_worker != this) {
    std::lock_guard<std::mutex> lock(dep_worker->mu_);
    if (dep_ticket >= dep_worker->next_ticket_)
      throw std::runtime_error("memo.rounding: a copy depends on ticket " + std::to_string(dep_ticket) +
                               " that worker '" + dep_worker->name_ + "' never issued");
    dep = dep_worker->progress_;
  }
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw std::runtime_error("memo.rounding: copy worker '" + name_ + "' is stopped");
    ticket = next_ticket_++;
    queue_.push_back(Job{ticket, dst, src, nbytes, std::move(dep), dep_ticket});
  }
  cv_work_.notify_one();
  return ticket;
}

void CopyWorker::Progress::wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mu);
  cv_done.wait(lock, [&] { return completed >= ticket; });
}

uint64_t CopyWorker::wait(uint64_t ticket) {
  auto start = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ticket >= next_ticket_) {
      throw std::runtime_error("memo.rounding: wait on ticket " + std::to_string(ticket) +
                               " that worker '" + name_ + "' never issued");
    }
  }
  progress_->wait(ticket);
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
}

bool CopyWorker::query(uint64_t ticket) const {
  std::lock_guard<std::mutex> lock(progress_->mu);
  return progress_->completed >= ticket;
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
  std::lock_guard<std::mutex> lock(progress_->mu);
  return progress_->completed;
}

uint64_t CopyWorker::submitted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_ticket_ - 1;
}

uint64_t CopyWorker::bytes_copied() const {
  std::lock_guard<std::mutex> lock(progress_->mu);
  return progress_->bytes_copied;
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
    if (job.dep != nullptr) job.dep->wait(job.dep_ticket);
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    if (job.nbytes > 0) std::memcpy(job.dst, job.src, job.nbytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.pop_front();
    }
    {
      std::lock_guard<std::mutex> lock(progress_->mu);
      progress_->completed = job.ticket;
      progress_->bytes_copied += job.nbytes;
    }
    progress_->cv_done.notify_all();
  }
}

HostArena::HostArena(size_t nbytes) : nbytes_(nbytes) {
  if (nbytes == 0) return;
  constexpr size_t kAlign = 4096;
  size_t rounded = (nbytes + kAlign - 1) / kAlign * kAlign;
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, rounded) != 0 || p == nullptr) throw std::bad_alloc();
  data_.reset(p);
  // Touch every page so the memory is committed now, not at the first offload.
  std::memset(p, 0, rounded);
}

}  // namespace memo::runtime
