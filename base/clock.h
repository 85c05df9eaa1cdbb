// Monotonic time for measuring durations (step times, solve times, benchmarks). Never
// wall-clock: a clock adjustment must not make a duration negative.
#ifndef RACKRUN_BASE_CLOCK_H_
#define RACKRUN_BASE_CLOCK_H_

#include <chrono>

namespace rackrun::base {

using MonotonicClock = std::chrono::steady_clock;

// Seconds on the monotonic clock since an arbitrary fixed point; only differences mean
// anything.
inline double NowSeconds() {
  return std::chrono::duration<double>(MonotonicClock::now().time_since_epoch()).count();
}

// Seconds elapsed since `since`.
inline double SecondsSince(MonotonicClock::time_point since) {
  return std::chrono::duration<double>(MonotonicClock::now() - since).count();
}

// Measures one interval: started at construction or Restart().
class Stopwatch {
 public:
  Stopwatch() : start_(MonotonicClock::now()) {}
  void Restart() { start_ = MonotonicClock::now(); }
  double Seconds() const { return SecondsSince(start_); }

 private:
  MonotonicClock::time_point start_;
};

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_CLOCK_H_
