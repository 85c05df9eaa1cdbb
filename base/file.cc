#include "base/file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/paths.h"

namespace rackrun::base {

absl::Status PosixError(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " '", path, "': ", std::strerror(errno)));
}

std::string TemporaryPath(const std::string& path) { return absl::StrCat(path, ".tmp-", getpid()); }

std::string FileKind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

namespace {

absl::Status NotRegular(const std::string& path, mode_t mode) {
  return absl::InvalidArgumentError(
      absl::StrCat("'", path, "' is ", FileKind(mode), ", not a regular file"));
}

// An open(2) failure of `path` as a Status (errno still set).
absl::Status OpenError(const std::string& path, absl::string_view verb = "cannot open") {
  if (errno == ENOENT) {
    return absl::NotFoundError(absl::StrCat(verb, " '", path, "': ", std::strerror(errno)));
  }
  return PosixError(verb, path);
}

// The folder a file is opened and renamed in (an O_PATH descriptor) and its name there.
struct Slot {
  int dir_fd = -1;
  std::string name;
  bool confined = false;  // opened from a job-file root: follow no symlink
};

// The folder of `path` as the path names it: the process's own files, and job files of an
// unconfined process (symlinks followed, as open(2) would).
absl::StatusOr<Slot> OpenSlotByPath(const std::string& path, absl::string_view verb,
                                    const std::string& shown) {
  const std::filesystem::path p(path);
  Slot slot;
  slot.name = p.filename().string();
  if (slot.name.empty() || slot.name == "." || slot.name == "..") {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' names a folder, not a file"));
  }
  const std::string folder = p.has_parent_path() ? p.parent_path().string() : ".";
  slot.dir_fd = ::open(folder.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (slot.dir_fd < 0) return OpenError(shown, verb);
  return slot;
}

// The folder of a job file of a confined process: `path` resolved now must lead beneath a
// root, and the folders from the root down are opened one by one without following a
// symlink, so one put there after the resolution fails the open instead of leading out.
absl::StatusOr<Slot> OpenConfinedSlot(const std::string& path,
                                      const std::vector<std::string>& roots) {
  const std::string listed = absl::StrCat(" (allowed roots: ", absl::StrJoin(roots, ", "), ")");
  absl::StatusOr<std::string> resolved = ResolvePath(path);
  if (!resolved.ok()) {
    return absl::PermissionDeniedError(
        absl::StrCat(resolved.status().message(), "; it cannot be confined", listed));
  }
  const std::string* root = nullptr;
  for (const std::string& r : roots) {
    if (PathIsWithin(*resolved, r)) {
      root = &r;
      break;
    }
  }
  if (root == nullptr) {
    return absl::PermissionDeniedError(absl::StrCat(
        "'", path, "'", *resolved == path ? "" : absl::StrCat(" leads to '", *resolved, "',"),
        " outside the folders this process may use", listed));
  }
  const std::vector<std::string> below =
      absl::StrSplit(absl::string_view(*resolved).substr(root->size()), '/', absl::SkipEmpty());
  if (below.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is an allowed root folder, not a file"));
  }
  Slot slot;
  slot.confined = true;
  slot.name = below.back();
  slot.dir_fd = ::open(root->c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  std::string at = *root;
  for (size_t i = 0; slot.dir_fd >= 0 && i + 1 < below.size(); ++i) {
    at = absl::StrCat(at, "/", below[i]);
    const int next =
        ::openat(slot.dir_fd, below[i].c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    const int err = errno;
    ::close(slot.dir_fd);
    slot.dir_fd = next;
    errno = err;
  }
  if (slot.dir_fd >= 0) return slot;
  if (errno == ELOOP || errno == ENOTDIR) {
    return absl::PermissionDeniedError(
        absl::StrCat("'", path, "': '", at,
                     "' was replaced by a symbolic link or a file after the path was "
                     "checked; not followed",
                     listed));
  }
  return OpenError(at);
}

// `verb` and `shown` (the path as errors name it: a temporary's) for an unusable folder.
absl::StatusOr<Slot> OpenSlot(const std::string& path, FileUse use,
                              absl::string_view verb = "cannot open",
                              const std::string& shown = "") {
  const std::vector<std::string>& roots = JobFileRoots();
  if (use == FileUse::kJob && !roots.empty()) return OpenConfinedSlot(path, roots);
  return OpenSlotByPath(path, verb, shown.empty() ? path : shown);
}

// Opens `name` in `slot` as OpenRegularFile does; `path` names it in errors.
absl::StatusOr<int> OpenInSlot(const Slot& slot, const std::string& name, const std::string& path,
                               int flags, mode_t mode, absl::string_view verb = "cannot open") {
  const int open_flags =
      (flags & ~O_TRUNC) | O_NONBLOCK | O_NOCTTY | O_CLOEXEC | (slot.confined ? O_NOFOLLOW : 0);
  const int fd = ::openat(slot.dir_fd, name.c_str(), open_flags, mode);
  if (fd < 0) {
    const int err = errno;
    struct stat st {};
    // ENXIO: a FIFO without a reader opened for writing; ELOOP: a symlink under O_NOFOLLOW.
    if (::fstatat(slot.dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        !S_ISREG(st.st_mode) && (err == ENXIO || err == ELOOP || err == EISDIR || err == ENODEV)) {
      if (S_ISLNK(st.st_mode)) {
        return absl::PermissionDeniedError(absl::StrCat(
            "'", path, "' became a symbolic link after the path was checked; not followed"));
      }
      return NotRegular(path, st.st_mode);
    }
    errno = err;
    return OpenError(path, verb);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    absl::Status s = PosixError("cannot examine", path);
    ::close(fd);
    return s;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return NotRegular(path, st.st_mode);
  }
  if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0 ||
      ((flags & O_TRUNC) != 0 && ::ftruncate(fd, 0) != 0)) {
    absl::Status s = PosixError("cannot open", path);
    ::close(fd);
    return s;
  }
  return fd;
}

}  // namespace

absl::StatusOr<int> OpenRegularFile(const std::string& path, int flags, FileUse use, mode_t mode) {
  absl::StatusOr<Slot> slot = OpenSlot(path, use);
  if (!slot.ok()) return slot.status();
  absl::StatusOr<int> fd = OpenInSlot(*slot, slot->name, path, flags, mode);
  ::close(slot->dir_fd);
  return fd;
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes) {
  absl::StatusOr<int> fd = OpenRegularFile(path, O_RDONLY, FileUse::kOwn);
  if (!fd.ok()) return fd.status();
  std::string bytes;
  char buffer[4096];
  while (true) {
    const ssize_t n = ::read(*fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status s = PosixError("cannot read", path);
      ::close(*fd);
      return s;
    }
    if (n == 0) break;
    bytes.append(buffer, static_cast<size_t>(n));
    if (bytes.size() > max_bytes) {
      ::close(*fd);
      return absl::InvalidArgumentError(absl::StrCat("'", path, "' is larger than ", max_bytes,
                                                     " bytes, the most such a file may hold"));
    }
  }
  ::close(*fd);
  return bytes;
}

absl::StatusOr<AtomicFileWriter> AtomicFileWriter::Open(const std::string& path, FileUse use) {
  std::string tmp = TemporaryPath(path);
  absl::StatusOr<Slot> slot = OpenSlot(path, use, "cannot create", tmp);
  if (!slot.ok()) return slot.status();
  std::string tmp_name = TemporaryPath(slot->name);
  // The temporary is ours alone: never a symlink followed, whatever the confinement.
  Slot own = *slot;
  own.confined = true;
  absl::StatusOr<int> fd =
      OpenInSlot(own, tmp_name, tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644, "cannot create");
  if (!fd.ok()) {
    ::close(slot->dir_fd);
    return fd.status();
  }
  return AtomicFileWriter(path, std::move(tmp), *fd, slot->dir_fd, slot->name, std::move(tmp_name));
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      tmp_(std::move(other.tmp_)),
      fd_(std::exchange(other.fd_, -1)),
      dir_fd_(std::exchange(other.dir_fd_, -1)),
      name_(std::move(other.name_)),
      tmp_name_(std::move(other.tmp_name_)) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    path_ = std::move(other.path_);
    tmp_ = std::move(other.tmp_);
    fd_ = std::exchange(other.fd_, -1);
    dir_fd_ = std::exchange(other.dir_fd_, -1);
    name_ = std::move(other.name_);
    tmp_name_ = std::move(other.tmp_name_);
  }
  return *this;
}

AtomicFileWriter::~AtomicFileWriter() { Abandon(); }

void AtomicFileWriter::Abandon() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
    ::unlinkat(dir_fd_, tmp_name_.c_str(), 0);
  }
  if (dir_fd_ >= 0) ::close(std::exchange(dir_fd_, -1));
}

absl::Status AtomicFileWriter::Append(std::string_view bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("'", path_, "' is closed"));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status s = PosixError("cannot write", tmp_);
      Abandon();
      return s;
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("'", path_, "' is closed"));
  if (::fsync(fd_) != 0) {
    absl::Status s = PosixError("cannot fsync", tmp_);
    Abandon();
    return s;
  }
  const int fd = std::exchange(fd_, -1);
  const int dir_fd = std::exchange(dir_fd_, -1);
  const auto fail = [&](absl::string_view what, const std::string& path) {
    absl::Status s = PosixError(what, path);
    ::unlinkat(dir_fd, tmp_name_.c_str(), 0);
    ::close(dir_fd);
    return s;
  };
  if (::close(fd) != 0) return fail("cannot close", tmp_);
  // Within the folder opened at Open: a folder on the way swapped for a symlink since then
  // cannot redirect the file.
  if (::renameat(dir_fd, tmp_name_.c_str(), dir_fd, name_.c_str()) != 0) {
    return fail("cannot rename onto", path_);
  }
  // The rename is durable only once the folder entry is on disk.
  const std::string folder = std::filesystem::path(path_).parent_path().string();
  const int sync_fd = ::openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ::close(dir_fd);
  if (sync_fd < 0) return PosixError("cannot open folder", folder.empty() ? "." : folder);
  const int rc = ::fsync(sync_fd);
  ::close(sync_fd);
  if (rc != 0) return PosixError("cannot fsync folder", folder.empty() ? "." : folder);
  return absl::OkStatus();
}

std::string HostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "unknown-host";
  return name;
}

absl::StatusOr<std::vector<std::string>> RemoveStaleTemporaries(
    const std::string& dir, bool (*is_target)(const std::string& name)) {
  std::vector<std::string> removed;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot list '", dir, "': ", ec.message()));
  }
  for (const std::filesystem::directory_entry& entry : it) {
    const std::string name = entry.path().filename().string();
    const size_t at = name.rfind(".tmp-");
    if (at == std::string::npos || at + 5 == name.size()) continue;
    const std::string digits = name.substr(at + 5);
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) continue;
    if (!is_target(name.substr(0, at))) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid == getpid()) continue;
    // kill(pid, 0) succeeds (or fails with EPERM) while such a process exists.
    if (pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM)) continue;
    if (::unlink(entry.path().c_str()) != 0 && errno != ENOENT) {
      return PosixError("cannot remove stale temporary file", entry.path().string());
    }
    removed.push_back(entry.path().string());
  }
  return removed;
}

absl::StatusOr<FolderLock> FolderLock::Acquire(const std::string& dir, absl::string_view what,
                                               FileUse use) {
  const std::string path = (std::filesystem::path(dir) / "LOCK").string();
  absl::StatusOr<int> opened = OpenRegularFile(path, O_RDWR | O_CREAT, use);
  if (!opened.ok()) {
    return absl::Status(
        opened.status().code(),
        absl::StrCat(what, ": cannot create the lock file: ", opened.status().message()));
  }
  const int fd = *opened;
  struct flock lock = {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  if (::fcntl(fd, F_OFD_SETLK, &lock) != 0) {
    const int err = errno;
    ::close(fd);
    if (err != EAGAIN && err != EACCES) {
      errno = err;
      return PosixError(absl::StrCat(what, ": cannot lock"), path);
    }
    absl::StatusOr<std::string> holder = ReadWholeFile(path, use);
    std::string who = holder.ok() ? *holder : std::string();
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    if (who.empty()) who = "another process (it has not yet written its pid and host)";
    return absl::FailedPreconditionError(
        absl::StrCat(what, " '", dir, "' is in use by ", who, " (lock file '", path,
                     "'); wait for that run to end, stop it, or use another folder"));
  }
  char stamp[32] = {};
  const std::time_t now = std::time(nullptr);
  struct tm utc = {};
  gmtime_r(&now, &utc);
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%SZ", &utc);
  const std::string holder =
      absl::StrCat("pid ", getpid(), " on host ", HostName(), " since ", stamp, "\n");
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, holder.data(), holder.size(), 0) != static_cast<ssize_t>(holder.size())) {
    absl::Status s = PosixError(absl::StrCat(what, ": cannot write the lock file"), path);
    ::close(fd);
    return s;
  }
  return FolderLock(fd, path);
}

FolderLock& FolderLock::operator=(FolderLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

FolderLock::~FolderLock() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes, FileUse use) {
  absl::StatusOr<AtomicFileWriter> writer = AtomicFileWriter::Open(path, use);
  if (!writer.ok()) return writer.status();
  if (absl::Status s = writer->Append(bytes); !s.ok()) return s;
  return writer->Commit();
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, FileUse use) {
  absl::StatusOr<int> opened = OpenRegularFile(path, O_RDONLY, use);
  if (!opened.ok()) {
    if (opened.status().code() != absl::StatusCode::kInternal) return opened.status();
    return absl::NotFoundError(opened.status().message());
  }
  const int fd = *opened;
  std::string bytes;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status s = PosixError("cannot read", path);
      ::close(fd);
      return s;
    }
    if (n == 0) break;
    bytes.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return bytes;
}

}  // namespace rackrun::base
