// The SentencePiece module (sentencepiece_backend.h) as seen from the process: loaded once
// into a link namespace of its own, then used through these wrappers. Thread-safe.
#ifndef RACKRUN_DATA_SENTENCEPIECE_LIBRARY_H_
#define RACKRUN_DATA_SENTENCEPIECE_LIBRARY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rackrun::data::spm {

class Model {
 public:
  // From the bytes of a .model file. FailedPrecondition when the module cannot be loaded,
  // InvalidArgument with the library's reason when it refuses the bytes.
  static absl::StatusOr<std::unique_ptr<Model>> Load(std::string_view bytes);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Appends the ids of `text`.
  absl::Status Encode(std::string_view text, std::vector<int32_t>& ids) const;
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const;

  int32_t pieces() const { return info_[0]; }
  int32_t bos() const { return info_[1]; }
  int32_t eos() const { return info_[2]; }
  int32_t pad() const { return info_[3]; }
  int32_t unk() const { return info_[4]; }

 private:
  explicit Model(void* handle);
  void* handle_;
  int32_t info_[5] = {0, -1, -1, -1, -1};
};

// SentencePieceTrainer::Train with the library's flag string (`--vocab_size=4096
// --model_type=bpe ...`, no --input) over the sentences `next` yields (false: no more):
// the serialized model. InvalidArgument with the library's reason.
absl::StatusOr<std::string> Train(const std::string& args,
                                  const std::function<bool(std::string*)>& next);

}  // namespace rackrun::data::spm

#endif  // RACKRUN_DATA_SENTENCEPIECE_LIBRARY_H_
