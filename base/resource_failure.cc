#include "base/resource_failure.h"

#include "absl/strings/str_cat.h"

namespace rackrun::base {

absl::Status OutOfMemoryError() {
  return absl::ResourceExhaustedError(
      "out of memory: an allocation failed although the job's memory estimate fit when it "
      "started (other processes took memory since, or a ulimit -v or cgroup limit is lower); "
      "lower the model or batch sizes, or free memory");
}

absl::Status SystemError(const std::system_error& error) {
  if (error.code() == std::errc::resource_unavailable_try_again) {
    return absl::ResourceExhaustedError(
        absl::StrCat("could not start a thread (", error.what(),
                     "): the process is out of memory or of threads (ulimit -v, ulimit -u or "
                     "the cgroup's pids.max); lower the model or batch sizes or raise the limit"));
  }
  return absl::InternalError(absl::StrCat("a system call failed: ", error.what()));
}

}  // namespace rackrun::base
