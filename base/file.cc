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

#include "absl/strings/str_cat.h"

namespace rackrun::base {

absl::Status PosixError(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " '", path, "': ", std::strerror(errno)));
}

std::string TemporaryPath(const std::string& path) { return absl::StrCat(path, ".tmp-", getpid()); }

absl::StatusOr<AtomicFileWriter> AtomicFileWriter::Open(const std::string& path) {
  std::string tmp = TemporaryPath(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return PosixError("cannot create", tmp);
  return AtomicFileWriter(path, std::move(tmp), fd);
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)), tmp_(std::move(other.tmp_)), fd_(std::exchange(other.fd_, -1)) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    path_ = std::move(other.path_);
    tmp_ = std::move(other.tmp_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

AtomicFileWriter::~AtomicFileWriter() { Abandon(); }

void AtomicFileWriter::Abandon() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
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
  if (::close(fd) != 0) {
    absl::Status s = PosixError("cannot close", tmp_);
    ::unlink(tmp_.c_str());
    return s;
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    absl::Status s = PosixError("cannot rename onto", path_);
    ::unlink(tmp_.c_str());
    return s;
  }
  // The rename is durable only once the folder entry is on disk.
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  const std::string folder = parent.empty() ? std::string(".") : parent.string();
  const int dir_fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return PosixError("cannot open folder", folder);
  const int rc = ::fsync(dir_fd);
  ::close(dir_fd);
  if (rc != 0) return PosixError("cannot fsync folder", folder);
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

absl::StatusOr<FolderLock> FolderLock::Acquire(const std::string& dir, absl::string_view what) {
  const std::string path = (std::filesystem::path(dir) / "LOCK").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return PosixError(absl::StrCat(what, ": cannot create the lock file"), path);
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
    absl::StatusOr<std::string> holder = ReadWholeFile(path);
    std::string who = holder.ok() ? *holder : std::string();
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    if (who.empty()) who = "another process (it has not yet written its pid and host)";
    return absl::FailedPreconditionError(absl::StrCat(
        what, " '", dir, "' is in use by ", who, " (lock file '", path,
        "'); wait for that run to end, stop it, or use another folder"));
  }
  char stamp[32] = {};
  const std::time_t now = std::time(nullptr);
  struct tm utc = {};
  gmtime_r(&now, &utc);
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%SZ", &utc);
  const std::string holder = absl::StrCat("pid ", getpid(), " on host ", HostName(), " since ", stamp, "\n");
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

absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  absl::StatusOr<AtomicFileWriter> writer = AtomicFileWriter::Open(path);
  if (!writer.ok()) return writer.status();
  if (absl::Status s = writer->Append(bytes); !s.ok()) return s;
  return writer->Commit();
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return absl::NotFoundError(absl::StrCat("cannot open '", path, "': ", std::strerror(errno)));
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
