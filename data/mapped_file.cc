#include "data/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace rackrun::data {

absl::StatusOr<MappedFile> MappedFile::Open(const std::string& path, absl::string_view what,
                                            Access access) {
  const auto error = [&](absl::string_view doing) {
    const int e = errno;
    std::string message =
        absl::StrCat("cannot ", doing, " ", what, " '", path, "': ", std::strerror(e));
    return e == ENOENT ? absl::NotFoundError(message) : absl::InternalError(message);
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return error("open");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    absl::Status s = error("examine");
    ::close(fd);
    return s;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(what, " '", path, "' is not a regular file"));
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
