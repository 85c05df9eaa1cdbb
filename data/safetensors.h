// The safetensors format (Hugging Face): the weights file PyTorch, NumPy, JAX and the
// `safetensors` package read without running code.
//
// Layout: uint64 little-endian N; N bytes of a UTF-8 JSON header (padded with spaces to a
// multiple of 8); then the byte buffer. The header maps each tensor name to {"dtype":
// "F32"|"F64"|"F16"|"BF16"|"I64"|"I32"|"I16"|"I8"|"U8"|"BOOL"|..., "shape": [...],
// "data_offsets": [begin, end]} (offsets into the buffer, little-endian row-major data) and
// may hold "__metadata__": {string: string}. The tensors tile the buffer exactly.
#ifndef RACKRUN_DATA_SAFETENSORS_H_
#define RACKRUN_DATA_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "data/mapped_file.h"

namespace rackrun::data {

struct SafeTensor {
  std::string name;
  std::string dtype = "F32";
  std::vector<int64_t> shape;
  std::string_view bytes;  // prod(shape) x the dtype's size, little-endian
};

// Bytes per element of a safetensors dtype; 0 when unknown.
size_t SafetensorsDTypeBytes(std::string_view dtype);

// Writes `tensors` (their data back to back in the given order) and `metadata` to `path`
// atomically. Names must be unique and
// not "__metadata__"; each tensor's byte count must match its shape and dtype.
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafeTensor>& tensors,
                              const std::map<std::string, std::string>& metadata);

// A safetensors file, memory-mapped and checked whole at Open (header size, JSON, dtypes,
// shapes against offsets, the tensors tiling the buffer): InvalidArgument naming the file.
class SafetensorsFile {
 public:
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  // In the header's order of offsets.
  const std::vector<SafeTensor>& tensors() const { return tensors_; }
  const SafeTensor* Find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  MappedFile file_;
  std::vector<SafeTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace rackrun::data

#endif  // RACKRUN_DATA_SAFETENSORS_H_
