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
// This file is independent of PyTorch; its Python bindings live in python/rounding_bindings.cpp.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
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
  uint64_t submit(void* dst, const void* src, size_t nbytes, CopyWorker* dep_worker = nullptr,
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
  struct Job {
    uint64_t ticket;
    void* dst;
    const void* src;
    size_t nbytes;
    CopyWorker* dep_worker;
    uint64_t dep_ticket;
  };
  void run();

  std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_work_;
  mutable std::condition_variable cv_done_;
  std::deque<Job> queue_;
  uint64_t next_ticket_ = 1;
  uint64_t completed_ = 0;  // tickets are completed in order: every ticket <= completed_ is done
  uint64_t bytes_copied_ = 0;
  uint64_t max_delay_us_;
  std::mt19937_64 rng_;
  bool stop_ = false;
  std::thread thread_;
};

// Host arena: one aligned allocation holding the offloaded bytes of all layers.
// Allocated once; every page is touched at construction so that a request the
// machine cannot back fails here, before training starts.
class HostArena {
 public:
  explicit HostArena(size_t nbytes);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;
  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
};

}  // namespace memo::runtime
