// The SentencePiece library behind a header free of Abseil: Debian's libsentencepiece-dev
// declares `namespace absl { using std::string_view; }`, which clashes with Debian's Abseil
// (its own absl::string_view class), so only sentencepiece_backend.cc includes the library's
// headers, and nothing there includes Abseil. tokenizer.cc wraps this in the Tokenizer
// interface. Errors come back as text; the caller makes them Status values.
#ifndef RACKRUN_DATA_SENTENCEPIECE_BACKEND_H_
#define RACKRUN_DATA_SENTENCEPIECE_BACKEND_H_

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace rackrun::data::spm {

// One loaded model. Encode and Decode are const and thread-safe (the library's are).
class Processor {
 public:
  // From the bytes of a .model file (a serialized ModelProto); null with `error` set when
  // the library refuses them.
  static std::unique_ptr<Processor> FromSerialized(const std::string& model, std::string* error);
  ~Processor();

  // Appends nothing on failure (returns false, `error` set).
  bool Encode(std::string_view text, std::vector<int>* ids, std::string* error) const;
  bool Decode(const std::vector<int>& ids, std::string* text, std::string* error) const;

  int pieces() const;
  int bos() const;  // -1 when the model has none
  int eos() const;
  int pad() const;
  int unk() const;

 private:
  struct Impl;
  explicit Processor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// SentencePieceTrainer::Train with the library's flag string (`--vocab_size=4096
// --model_type=bpe ...`, no --input) over the sentences `next` yields (false: no more).
// On success `model` holds the serialized ModelProto (nothing is written to disk).
bool Train(const std::string& args, const std::function<bool(std::string*)>& next,
           std::string* model, std::string* error);

}  // namespace rackrun::data::spm

#endif  // RACKRUN_DATA_SENTENCEPIECE_BACKEND_H_
