// Read-only memory maps of data files: the one place data/ opens a file it reads
// (datasets, token files, tokenizer models), so that a job's opens can be confined or
// audited by wrapping this one function.
//
// A MappedFile maps the whole file PROT_READ, MAP_SHARED; nothing is read until a page is
// touched, so opening a file of any size costs nothing and reading a few windows of it
// reads only their pages. Empty files map to an empty view. Movable, not copyable; the
// view stays valid while the object lives. Thread-safe for concurrent reads.
#ifndef RACKRUN_DATA_MAPPED_FILE_H_
#define RACKRUN_DATA_MAPPED_FILE_H_

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rackrun::data {

class MappedFile {
 public:
  // How pages will be touched: the kernel's read-ahead is sized for it.
  enum class Access { kSequential, kRandom };

  // Maps `path`. NotFound / Internal naming `what` ("dataset index"), the path and the
  // system's reason.
  static absl::StatusOr<MappedFile> Open(const std::string& path, absl::string_view what,
                                         Access access = Access::kRandom);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::string_view bytes() const { return {data_, size_}; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void Unmap();

  const char* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

}  // namespace rackrun::data

#endif  // RACKRUN_DATA_MAPPED_FILE_H_
