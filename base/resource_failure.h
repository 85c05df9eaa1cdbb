// Resource shortages that C++ reports by throwing, turned into Status values at the one
// place that catches them: a process's edge (the worker's attempt, `rackrun train`). An
// allocation that fails (std::bad_alloc) or a thread that cannot start (std::system_error
// from std::thread's constructor: EAGAIN when the process may start no more threads) anywhere
// in a job then fails the job with a message instead of ending the process with
// std::terminate; everything below the edge returns Status and never catches them.
#ifndef RACKRUN_BASE_RESOURCE_FAILURE_H_
#define RACKRUN_BASE_RESOURCE_FAILURE_H_

#include <new>
#include <system_error>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rackrun::base {

// ResourceExhausted "out of memory: an allocation failed although the job's memory
// estimate fit when it started (...); lower the model or batch sizes".
absl::Status OutOfMemoryError();
// ResourceExhausted "could not start a thread (WHAT): the process is out of memory or of
// threads (...)" for EAGAIN; Internal "a system call failed: WHAT" for any other error.
absl::Status SystemError(const std::system_error& error);

// body()'s value, or the Status of a resource exception it threw (above). The objects the
// body made are destroyed by the unwinding before the Status is returned.
template <typename F>
absl::StatusOr<std::invoke_result_t<F>> CatchResourceFailures(F&& body) {
  try {
    return std::forward<F>(body)();
  } catch (const std::bad_alloc&) {
    return OutOfMemoryError();
  } catch (const std::system_error& e) {
    return SystemError(e);
  }
}

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_RESOURCE_FAILURE_H_
