// Whole-file reads and atomic whole-file writes, with errors that name the file and the
// system's reason.
#ifndef RACKRUN_BASE_FILE_H_
#define RACKRUN_BASE_FILE_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rackrun::base {

// Replaces `path` with `bytes` atomically: writes `<path>.tmp-<pid>`, fsyncs it, renames
// it over `path` and fsyncs the folder. On failure `path` is unchanged and the temporary
// file is removed. New files get mode 0644.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

// The temporary name WriteFileAtomically uses for `path` in this process.
std::string TemporaryPath(const std::string& path);

// Removes the temporaries WriteFileAtomically left in `dir` (files named
// `<name>.tmp-<pid>` for which `is_target(<name>)` holds) when their writer is gone: the
// pid is not this process and no live process on this host has it. A writer killed with
// -9 leaves such a file; call this while holding the folder's lock (FolderLock), so that
// no writer on another host can own one. Returns the removed paths; errors name the file.
absl::StatusOr<std::vector<std::string>> RemoveStaleTemporaries(
    const std::string& dir, bool (*is_target)(const std::string& name));

// An exclusive advisory lock on `<dir>/LOCK` (an open-file-description lock: it excludes
// other processes and other holders in this process, also over NFS, and is released when
// the holder closes it or dies). The file records "pid PID host HOST since TIME" of the
// holder, so that a refused writer can name it.
class FolderLock {
 public:
  // FailedPrecondition "<what> '<dir>' is in use by pid P on host H (since T)" when held
  // elsewhere; Internal with errno when the file cannot be created or locked.
  static absl::StatusOr<FolderLock> Acquire(const std::string& dir, absl::string_view what);
  FolderLock(FolderLock&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
    other.fd_ = -1;
  }
  FolderLock& operator=(FolderLock&& other) noexcept;
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  ~FolderLock();
  const std::string& path() const { return path_; }

 private:
  FolderLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

// This host's name (gethostname), "unknown-host" when unavailable.
std::string HostName();

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
