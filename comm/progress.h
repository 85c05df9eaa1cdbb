// How every wait loop in comm/ spends the time between two polling passes over its
// requests:
// - CompletionEvent: a transport whose transfers complete on its own threads (Gloo) bumps
//   the event on every completion or failure, and a waiter blocks on it instead of
//   polling, leaving the cores to those threads;
// - otherwise (MPI and NCCL progress only when tested) ProgressBackoff spins with yields
//   while progress is likely soon, then sleeps briefly so that oversubscribed ranks (more
//   ranks than cores, as in tests) leave the CPU to the peer they wait for.
// A loop calls StartPass() before each pass and Progress() or Idle(deadline) after it.
#ifndef RACKRUN_COMM_PROGRESS_H_
#define RACKRUN_COMM_PROGRESS_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rackrun::comm {

// A count of completed (or failed) transfers of one transport. Thread-safe. A waiter reads
// generation() before testing its requests; if none completed, WaitPast() returns as soon
// as any transfer has completed since that read, so no completion is missed.
class CompletionEvent {
 public:
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // Called by the transport after a transfer's outcome is visible to Test().
  void Notify() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    changed_.notify_all();
  }

  // Blocks until the generation differs from `seen` or `until` (a steady-clock time) passes.
  void WaitPast(uint64_t seen, std::chrono::steady_clock::time_point until) const {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_until(lock, until, [&] { return generation() != seen; });
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable changed_;
  std::atomic<uint64_t> generation_{0};
};

class ProgressBackoff {
 public:
  // `event`: the requests' transport's completion event, or null to poll.
  explicit ProgressBackoff(const CompletionEvent* event = nullptr) : event_(event) {}

  // Call before a polling pass.
  void StartPass() {
    if (event_ != nullptr) seen_ = event_->generation();
  }
  // Call after a polling pass that completed something.
  void Progress() { idle_passes_ = 0; }
  // Call after a polling pass that completed nothing; returns by `deadline` at the latest
  // (a blocked wait also wakes every kMaxBlock, a safety net for the caller's checks).
  void Idle(absl::Time deadline = absl::InfiniteFuture()) {
    if (event_ != nullptr) {
      const absl::Duration left =
          std::clamp(deadline - absl::Now(), absl::ZeroDuration(), kMaxBlock);
      event_->WaitPast(seen_, std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(left));
      return;
    }
    if (++idle_passes_ < kYieldPasses) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(kSleepMicros));
    }
  }

 private:
  static constexpr int kYieldPasses = 2000;
  static constexpr int kSleepMicros = 20;
  static constexpr absl::Duration kMaxBlock = absl::Milliseconds(50);
  const CompletionEvent* event_;
  uint64_t seen_ = 0;
  int idle_passes_ = 0;
};

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_PROGRESS_H_
