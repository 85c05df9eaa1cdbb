// What a daemon asks of the kernel at start, beyond signals (signals.h): enough file
// descriptors. Every connection a server holds takes one, and the default soft limit
// (1024 under systemd, whose hard limit is 524288) is what a flood of idle connections, or a
// large job's data-channel mesh, exhausts first: then accept fails and no new client gets
// in. The soft limit may be raised up to the hard one without privileges.
#ifndef RACKRUN_BASE_PROCESS_LIMITS_H_
#define RACKRUN_BASE_PROCESS_LIMITS_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace rackrun::base {

// Raises this process's soft limit on open files (RLIMIT_NOFILE) to its hard limit, capped
// at `cap` (an unlimited hard limit would make select()-based libraries misbehave), and
// returns the soft limit now in force. Internal naming getrlimit/setrlimit when the kernel
// refuses.
absl::StatusOr<int64_t> RaiseOpenFileLimit(int64_t cap = int64_t{1} << 20);

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_PROCESS_LIMITS_H_
