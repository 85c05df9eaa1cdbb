#include "data/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/file.h"

namespace rackrun::data {

absl::StatusOr<MappedFile> MappedFile::Open(const std::string& path, absl::string_view what,
                                            Access access) {
  const auto error = [&](absl::string_view doing) {
    const int e = errno;
    std::string message =
        absl::StrCat("cannot ", doing, " ", what, " '", path, "': ", std::strerror(e));
    return e == ENOENT ? absl::NotFoundError(message) : absl::InternalError(message);
  };
  // A dataset is a job's file: a regular file, opened without blocking (a FIFO would wedge
  // the reader), confined to a worker's --allowed-roots at this very open (base/file.h).
  absl::StatusOr<int> opened = base::OpenRegularFile(path, O_RDONLY, base::FileUse::kJob);
  if (!opened.ok()) {
    // "cannot open '/x': ..." names the file as what it is: "cannot open dataset index '/x'".
    std::string message(opened.status().message());
    constexpr absl::string_view kOpen = "cannot open '";
    if (absl::StartsWith(message, kOpen)) {
      message.insert(kOpen.size() - 1, absl::StrCat(what, " "));
    } else {
      message = absl::StrCat(what, ": ", message);
    }
    return absl::Status(opened.status().code(), message);
  }
  const int fd = *opened;
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    absl::Status s = error("examine");
    ::close(fd);
    return s;
  }
  MappedFile file;
  file.path_ = path;
  file.size_ = static_cast<size_t>(st.st_size);
  if (file.size_ > 0) {
    void* p = ::mmap(nullptr, file.size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      absl::Status s = error("map");
      ::close(fd);
      return s;
    }
    (void)::madvise(p, file.size_, access == Access::kRandom ? MADV_RANDOM : MADV_SEQUENTIAL);
    file.data_ = static_cast<const char*>(p);
  }
  ::close(fd);  // the mapping keeps the file
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      path_(std::move(other.path_)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    path_ = std::move(other.path_);
  }
  return *this;
}

MappedFile::~MappedFile() { Unmap(); }

void MappedFile::Unmap() {
  if (data_ != nullptr) ::munmap(const_cast<char*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace rackrun::data
