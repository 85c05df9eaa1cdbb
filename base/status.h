// Status helpers shared by every module.
#ifndef RACKRUN_BASE_STATUS_H_
#define RACKRUN_BASE_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace rackrun::base {

// `status` with "<what>: " in front of its message, code unchanged; OK stays OK. Used to
// say what the caller was doing when a lower layer failed ("all-reducing the loss at step
// 12: rank 1 timed out waiting for rank 0").
inline absl::Status Annotate(const absl::Status& status, absl::string_view what) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

}  // namespace rackrun::base

// Returns from the calling function when `expr` (an absl::Status) is not OK.
#define RACKRUN_RETURN_IF_ERROR(expr)                                                         \
  do {                                                                                        \
    if (absl::Status rackrun_status_ = (expr); !rackrun_status_.ok()) return rackrun_status_; \
  } while (false)

#endif  // RACKRUN_BASE_STATUS_H_
