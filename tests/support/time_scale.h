// Timing margins of the end-to-end tests that grow with how slow this machine is right
// now, so that a loaded 2-core machine or a sanitizer build does not turn a margin into a
// failure. A test that gives a daemon a timeout (hang, heartbeat, channel) or waits for
// something to happen multiplies its quiet-machine figure by TimeScale().
//
// TimeScale() = RACKRUN_TEST_TIME_SCALE when set (a number >= 1), otherwise
//   max(clamp(load, 1, 4) x (3 under ThreadSanitizer, 2 under AddressSanitizer, else 1),
//       RACKRUN_TEST_TIME_SCALE_MIN (default 1)),
// where load is the larger of the 1-minute load average and the runnable threads now,
// per core. The floor is for a test whose own processes load the machine after the
// measurement (CMake sets it per test). Measured once per test process and printed on stderr, so a
// failing test's output says which margins it ran with. Header-only.
#ifndef RACKRUN_TESTS_SUPPORT_TIME_SCALE_H_
#define RACKRUN_TESTS_SUPPORT_TIME_SCALE_H_

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace rackrun::testing {

inline double MeasureTimeScale() {
  if (const char* s = std::getenv("RACKRUN_TEST_TIME_SCALE"); s != nullptr && *s != '\0') {
    char* end = nullptr;
    const double v = std::strtod(s, &end);
    if (end != s && *end == '\0' && v >= 1) return v;
    std::fprintf(stderr,
                 "RACKRUN_TEST_TIME_SCALE='%s' is not a number >= 1; measuring the load instead\n",
                 s);
  }
  // /proc/loadavg: "1min 5min 15min runnable/total lastpid".
  double avg1 = 0;
  std::string runnable_total;
  std::ifstream("/proc/loadavg") >> avg1 >> runnable_total >> runnable_total >> runnable_total;
  const double runnable = std::atof(runnable_total.substr(0, runnable_total.find('/')).c_str());
  const double cores = std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN));
  double scale = std::clamp(std::max(avg1, runnable) / cores, 1.0, 4.0);
#if defined(__SANITIZE_THREAD__)
  scale *= 3;
#elif defined(__SANITIZE_ADDRESS__)
  scale *= 2;
#endif
  if (const char* s = std::getenv("RACKRUN_TEST_TIME_SCALE_MIN"); s != nullptr && *s != '\0') {
    char* end = nullptr;
    const double v = std::strtod(s, &end);
    if (end != s && *end == '\0' && v >= 1) {
      scale = std::max(scale, v);
    } else {
      std::fprintf(stderr, "RACKRUN_TEST_TIME_SCALE_MIN='%s' is not a number >= 1; ignored\n", s);
    }
  }
  return scale;
}

inline double TimeScale() {
  static const double scale = [] {
    const double s = MeasureTimeScale();
    std::fprintf(stderr, "test timing margins x%.2f (RACKRUN_TEST_TIME_SCALE to set)\n", s);
    return s;
  }();
  return scale;
}

// A quiet machine's figure, scaled.
inline int64_t ScaledMs(int64_t quiet_ms) { return static_cast<int64_t>(quiet_ms * TimeScale()); }
inline std::chrono::milliseconds Scaled(std::chrono::milliseconds quiet) {
  return std::chrono::milliseconds(ScaledMs(quiet.count()));
}

}  // namespace rackrun::testing

#endif  // RACKRUN_TESTS_SUPPORT_TIME_SCALE_H_
