// Whole-file reads and atomic whole-file writes, with errors that name the file and the
// system's reason.
#ifndef RACKRUN_BASE_FILE_H_
#define RACKRUN_BASE_FILE_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rackrun::base {

// Replaces `path` with `bytes` atomically: writes `<path>.tmp-<pid>`, fsyncs it, renames
// it over `path` and fsyncs the folder. On failure `path` is unchanged and the temporary
// file is removed. New files get mode 0644.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

// Reads the whole file at `path`; NotFound when it cannot be opened.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

// Internal error "<what> '<path>': <strerror(errno)>" from the current errno.
absl::Status PosixError(absl::string_view what, const std::string& path);

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_FILE_H_
