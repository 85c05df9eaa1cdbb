// The coordinator's locks: std::mutex and std::condition_variable (not absl::Mutex, whose
// synchronization ThreadSanitizer cannot see in Debian's uninstrumented Abseil, so every
// access it guards would be reported as a race). WaitUntil gives condition waits the
// absl::Time deadlines the coordinator computes with.
#ifndef RACKRUN_COORDINATOR_SYNC_H_
#define RACKRUN_COORDINATOR_SYNC_H_

#include <algorithm>
#include <condition_variable>
#include <mutex>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rackrun::coordinator {

using Lock = std::unique_lock<std::mutex>;

// Waits on `cv` (with `lock` held) until notified or `deadline`; true once the deadline has
// passed (false on a notification or a spurious wake-up: callers re-check their condition).
// Far deadlines (absl::InfiniteFuture()) are waited in one-day steps, because std::chrono's
// clock conversions overflow on them.
inline bool WaitUntil(std::condition_variable& cv, Lock& lock, absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return true;
  cv.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Hours(24))));
  return absl::Now() >= deadline;
}

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_SYNC_H_
