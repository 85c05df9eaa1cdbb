// Whole-file reads and atomic whole-file writes, with errors that name the file and the
// system's reason.
//
// Every open here is of a regular file and never blocks: the file is opened with
// O_NONBLOCK, checked with fstat, and anything else (a FIFO, a device, a socket, a
// directory) is refused naming what it is ("'/x' is a FIFO, not a regular file"); then
// O_NONBLOCK is cleared for the caller's reads and writes. A FIFO given as a data, log,
// token or trace file used to block its reader (a worker, the coordinator) for ever.
//
// Job files (FileUse::kJob: the paths of a job spec) of a process with job-file roots
// (base/paths.h; rackrun-worker --allowed-roots) are confined at every open: the path is
// resolved now (dangling symlinks included), must lead beneath a root, and is then opened
// from the root's folder one component at a time with O_NOFOLLOW, so a symlink put in
// place after the attempt's start check (or between the resolution and the open) is never
// followed: the open fails naming the path. An atomic write creates its temporary and
// renames it within the folder so opened (openat, renameat).
#ifndef RACKRUN_BASE_FILE_H_
#define RACKRUN_BASE_FILE_H_

#include <sys/types.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rackrun::base {

// Whom a file is opened for: the process itself (its tokens, certificates, /proc), or a
// job (a path of its spec: data, checkpoints, logs, load traces), which is confined to
// the job-file roots when the process has any (base/paths.h).
enum class FileUse { kOwn, kJob };

// What a file of `mode` (st_mode) is, for messages: "a directory", "a FIFO", "a socket",
// "a character device", "a block device", "a symbolic link", "a regular file".
std::string FileKind(mode_t mode);

// Opens `path` with open(2) `flags` (O_RDONLY, O_WRONLY | O_CREAT | O_APPEND, ...; O_CLOEXEC
// is added; O_TRUNC is applied after the check, so nothing but a regular file is ever
// truncated) and `mode` for a new file. Never blocks; refuses what is not a regular file
// (InvalidArgument naming the path and its kind); NotFound when it does not exist;
// PermissionDenied for a job file that leads outside the roots or through a symlink that
// appeared after it was resolved; Internal with errno otherwise. The caller owns the
// descriptor.
absl::StatusOr<int> OpenRegularFile(const std::string& path, int flags, FileUse use = FileUse::kOwn,
                                    mode_t mode = 0644);

// A small file of the process's own (a token, a certificate, a key) read whole: a regular
// file of at most `max_bytes` (InvalidArgument naming the path, its size and the bound
// beyond). Never confined. Errors as OpenRegularFile's.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes);

// Replaces `path` with `bytes` atomically: writes `<path>.tmp-<pid>`, fsyncs it, renames
// it over `path` and fsyncs the folder. On failure `path` is unchanged and the temporary
// file is removed. New files get mode 0644.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes,
                                 FileUse use = FileUse::kOwn);

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
  static absl::StatusOr<FolderLock> Acquire(const std::string& dir, absl::string_view what,
                                            FileUse use = FileUse::kOwn);
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
  static absl::StatusOr<AtomicFileWriter> Open(const std::string& path,
                                               FileUse use = FileUse::kOwn);
  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  absl::Status Append(std::string_view bytes);
  absl::Status Commit();
  const std::string& path() const { return path_; }

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd, int dir_fd, std::string name,
                   std::string tmp_name)
      : path_(std::move(path)),
        tmp_(std::move(tmp)),
        fd_(fd),
        dir_fd_(dir_fd),
        name_(std::move(name)),
        tmp_name_(std::move(tmp_name)) {}
  void Abandon();  // closes and removes the temporary file

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  int dir_fd_ = -1;       // the folder (O_PATH) the temporary is created and renamed in
  std::string name_;      // the file's name in it
  std::string tmp_name_;  // the temporary's
};

// Reads the whole regular file at `path`; NotFound when it cannot be opened, other errors
// as OpenRegularFile's.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path, FileUse use = FileUse::kOwn);

// Internal error "<what> '<path>': <strerror(errno)>" from the current errno.
absl::Status PosixError(absl::string_view what, const std::string& path);

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_FILE_H_
