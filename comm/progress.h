// Polling backoff shared by every wait loop in comm/: spin with yields while progress is
// likely soon, then sleep briefly so that oversubscribed ranks (more ranks than cores, as
// in tests) leave the CPU to the peer they wait for.
#ifndef RACKRUN_COMM_PROGRESS_H_
#define RACKRUN_COMM_PROGRESS_H_

#include <chrono>
#include <thread>

namespace rackrun::comm {

class ProgressBackoff {
 public:
  // Call after a polling pass that completed nothing.
  void Idle() {
    if (++idle_passes_ < kYieldPasses) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(kSleepMicros));
    }
  }
  // Call after a polling pass that completed something.
  void Progress() { idle_passes_ = 0; }

 private:
  static constexpr int kYieldPasses = 2000;
  static constexpr int kSleepMicros = 20;
  int idle_passes_ = 0;
};

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_PROGRESS_H_
