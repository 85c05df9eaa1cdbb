// Helpers shared by the coordinator's unit tests: a scratch folder and a fake clock.
#ifndef RACKRUN_COORDINATOR_TEST_UTIL_H_
#define RACKRUN_COORDINATOR_TEST_UTIL_H_

#include <stdlib.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <string>

#include "coordinator/clock.h"

namespace rackrun::coordinator::testing {

// A fresh folder under $TMPDIR (or /tmp), removed at destruction.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "rackrun-coord-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class FakeClock {
 public:
  explicit FakeClock(int64_t start_ms = 1'700'000'000'000) : now_(start_ms) {}
  Clock clock() {
    return [this] { return now_.load(); };
  }
  void Advance(int64_t ms) { now_ += ms; }
  int64_t now() const { return now_.load(); }

 private:
  std::atomic<int64_t> now_;
};

}  // namespace rackrun::coordinator::testing

#endif  // RACKRUN_COORDINATOR_TEST_UTIL_H_
