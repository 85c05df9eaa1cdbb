// Whole-file reads and atomic whole-file writes, with errors that name the file and the
// system's reason.
#ifndef RACKRUN_BASE_FILE_H_
#define RACKRUN_BASE_FILE_H_

#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rackrun::base {

// Replaces `path` with `bytes` atomically: writes `<path>.tmp-<pid>`, fsyncs it, renames
// it over `path` and fsyncs the folder. On failure `path` is unchanged and the temporary
// file is removed. New files get mode 0644.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

// The same for output produced piece by piece (a long trace): Open creates the temporary
// file, Append writes to it, Commit fsyncs and renames it over `path`. Until Commit
// succeeds `path` is untouched; a writer destroyed without a successful Commit (an error,
// an early return) removes its temporary file, so the output is complete or absent.
// Errors name the file and errno. Movable, not thread-safe.
class AtomicFileWriter {
 public:
  static absl::StatusOr<AtomicFileWriter> Open(const std::string& path);
  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  absl::Status Append(std::string_view bytes);
  absl::Status Commit();
  const std::string& path() const { return path_; }

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd)
      : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}
  void Abandon();  // closes and removes the temporary file

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
};

// Reads the whole file at `path`; NotFound when it cannot be opened.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

// Internal error "<what> '<path>': <strerror(errno)>" from the current errno.
absl::Status PosixError(absl::string_view what, const std::string& path);

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_FILE_H_
