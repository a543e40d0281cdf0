// Rounding-buffer copy engine for the CPU backend: an asynchronous copy worker.
//
// NOTE [CPU copy worker]
// On CUDA the rounding buffers move through two copy streams (offload D2H,
// prefetch H2D) ordered by events. The CPU backend has no streams, so each
// stream is stood in for by a CopyWorker: its own thread draining a FIFO queue
// of memcpy jobs. submit() returns a ticket (the "event"); wait(ticket) blocks
// the caller until that job and every earlier one on the worker are done, just
// like cudaEventSynchronize on an event recorded on the stream. A job may
// depend on a ticket of another worker (cudaStreamWaitEvent): the worker waits
// for it before copying. Copies are real memcpy calls running concurrently with
// the compute thread, so a missing wait in the runtime's protocol corrupts data
// and shows up as a wrong gradient in CPU tests. An optional random delay
// before each job (debug switch) widens every race window.
//
// NOTE [Copy worker lifetimes]
// Safe by construction, whatever order Python drops things in:
// * A job that depends on another worker holds that worker's Progress (its
//   completed-ticket count, mutex and condition variable) by shared_ptr, never
//   the worker itself: the other worker may be destroyed while the job is
//   queued, and its Progress stays valid for as long as the job needs it.
// * The destructor drains: it stops new submissions, lets the thread finish
//   every queued job, then joins it, before any member dies. So every ticket a
//   worker issued is completed before it goes, and a job waiting on the
//   Progress of a destroyed worker never waits forever.
// * The bytes a job copies (dst, src) are the caller's: it keeps them alive
//   until the ticket completes (wait/synchronize), as with a CUDA stream.
//
// This file is independent of PyTorch; its Python bindings live in python/rounding_bindings.cpp.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>

namespace memo::runtime {

class CopyWorker {
 public:
  // max_delay_us > 0 sleeps a uniform random 0..max_delay_us before each job.
  CopyWorker(std::string name, uint64_t max_delay_us, uint64_t seed);
  ~CopyWorker();
  CopyWorker(const CopyWorker&) = delete;
  CopyWorker& operator=(const CopyWorker&) = delete;

  // Queue memcpy(dst, src, nbytes); if dep_worker is given, the copy starts only
  // once dep_worker has completed dep_ticket. Returns this job's ticket (>= 1).
  uint64_t submit(void* dst, const void* src, size_t nbytes, const CopyWorker* dep_worker = nullptr,
                  uint64_t dep_ticket = 0);
  // Block until the job with this ticket is done; returns nanoseconds spent waiting.
  uint64_t wait(uint64_t ticket);
  // Whether the job with this ticket is done (ticket 0 is always done).
  bool query(uint64_t ticket) const;
  // Block until every submitted job is done.
  void synchronize();

  void set_max_delay_us(uint64_t us);
  uint64_t max_delay_us() const;
  uint64_t completed() const;
  uint64_t submitted() const;
  uint64_t bytes_copied() const;
  const std::string& name() const { return name_; }

 private:
  // What waiting on a worker's tickets needs, shared with the jobs of other workers that depend on
  // them (NOTE [Copy worker lifetimes]).
  struct Progress {
    mutable std::mutex mu;
    std::condition_variable cv_done;
    uint64_t completed = 0;  // tickets are completed in order: every ticket <= completed is done
    uint64_t bytes_copied = 0;
    void wait(uint64_t ticket);
  };
  struct Job {
    uint64_t ticket;
    void* dst;
    const void* src;
    size_t nbytes;
    std::shared_ptr<Progress> dep;  // the other worker's progress, or null
    uint64_t dep_ticket;
  };
  void run();

  std::string name_;
  const std::shared_ptr<Progress> progress_ = std::make_shared<Progress>();
  mutable std::mutex mu_;  // the queue, tickets issued, delay and stop flag
  std::condition_variable cv_work_;
  std::deque<Job> queue_;
  uint64_t next_ticket_ = 1;
  uint64_t max_delay_us_;
  std::mt19937_64 rng_;
  bool stop_ = false;
  std::thread thread_;  // last: started after, and joined (in ~CopyWorker) before, every other member
};

// Host arena: one aligned allocation holding the offloaded bytes of all layers.
// Allocated once; every page is touched at construction so that a request the
// machine cannot back fails here, before training starts.
class HostArena {
 public:
  explicit HostArena(size_t nbytes);
  void* data() const { return data_.get(); }
  size_t nbytes() const { return nbytes_; }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }  // the posix_memalign'ed block
  };
  std::unique_ptr<void, Free> data_;
  size_t nbytes_ = 0;
};

}  // namespace memo::runtime
