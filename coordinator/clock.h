// The coordinator's notion of time: Unix milliseconds from an injectable source, so tests
// can make a worker "die" by moving a fake clock instead of sleeping.
#ifndef RACKRUN_COORDINATOR_CLOCK_H_
#define RACKRUN_COORDINATOR_CLOCK_H_

#include <chrono>
#include <cstdint>
#include <functional>

namespace rackrun::coordinator {

// Returns Unix milliseconds. Must be thread-safe.
using Clock = std::function<int64_t()>;

inline int64_t SystemNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

inline Clock SystemClock() { return &SystemNowMs; }

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_CLOCK_H_
