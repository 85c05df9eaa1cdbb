// Graceful stop on SIGTERM / SIGINT for long-running processes (rackrun train, the worker
// daemon): Slurm and systemd send SIGTERM before they kill.
//
// A handler (any thread may receive a process-directed signal: libraries such as OpenBLAS
// start threads before main, so blocking the signal in main is not enough) writes the
// signal number to a pipe; a watcher thread calls `on_first` for the first signal and ends
// the process at once (exit status 128 + signal) on the second. Call once per process.
#ifndef RACKRUN_BASE_SIGNALS_H_
#define RACKRUN_BASE_SIGNALS_H_

#include <functional>

#include "absl/status/status.h"

namespace rackrun::base {

absl::Status WatchStopSignals(std::function<void(int signal)> on_first);

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_SIGNALS_H_
