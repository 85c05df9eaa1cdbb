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

// Sets SIGPIPE to ignored unless the process has installed a handler of its own, so that a
// write to a socket or pipe whose reader is gone fails with EPIPE instead of killing the
// process with no message (exit 141). Every process of ours calls it first thing in main
// (the coordinator, the worker, the rackrun CLI, the benchmarks that talk to daemons): TLS
// libraries, Gloo and gRPC's peers may write to a connection the other side has closed.
// Idempotent and thread-safe.
void IgnoreSigpipe();

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_SIGNALS_H_
