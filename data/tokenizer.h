// Tokenizers behind one interface: text <-> token ids, the vocabulary size and the special
// ids (BOS, EOS, pad), and an identity (TokenizerInfo) that datasets and checkpoints record
// so that data and a model made with different tokenizers are never trained together.
//
// Two kinds:
//  - "bytes": ids 0..255 are the bytes of the text; 256 is the end-of-document mark (EOS,
//    also BOS); vocab 257; no pad. Decode(Encode(t)) == t for every byte string.
//  - "sentencepiece": a SentencePiece .model (BPE or unigram) through Debian's
//    libsentencepiece-dev; ids and specials as the model defines them (spm_train's
//    defaults: unk 0, bos 1, eos 2, pad none). Decode drops control ids.
// OpenTokenizer("bytes") or OpenTokenizer("path/to/m.model"); TrainSentencePiece makes a
// .model from a corpus with the library's trainer.
//
// Encode and Decode are const and thread-safe; `rackrun data` tokenizes on every core with
// one Tokenizer.
#ifndef RACKRUN_DATA_TOKENIZER_H_
#define RACKRUN_DATA_TOKENIZER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rackrun::data {

inline constexpr int kByteVocab = 257;
inline constexpr int32_t kByteEndOfDocument = 256;

// Who made a token stream. Two infos name the same tokenizer when kind, model type,
// vocab and model checksum agree (where the model file lives does not matter).
struct TokenizerInfo {
  std::string kind{};        // "bytes" | "sentencepiece" | "unknown" (data without a record)
  std::string model_type{};  // sentencepiece: "bpe" | "unigram" | "word" | "char"
  int32_t vocab = 0;
  int32_t bos = -1, eos = -1, pad = -1;  // -1: none
  uint32_t model_crc32c = 0;             // sentencepiece: CRC32C of the .model file's bytes
  std::string model{};                   // sentencepiece: the .model path it was read from

  bool SameTokenizer(const TokenizerInfo& other) const;
  // "sentencepiece bpe, vocab 4096 (model m.model, crc32c 0x1234abcd)", "bytes (vocab 257)".
  std::string Describe() const;
  // One JSON object: {"kind", "model_type", "vocab", "bos", "eos", "pad", "model_crc32c",
  // "model"}; FromJson refuses a missing kind or vocab, naming `origin`.
  std::string ToJson() const;
  static absl::StatusOr<TokenizerInfo> FromJson(std::string_view json, absl::string_view origin);
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Appends the ids of `text` to `ids`; nothing on failure.
  virtual absl::Status Encode(std::string_view text, std::vector<int32_t>& ids) const = 0;
  virtual absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const = 0;

  const TokenizerInfo& info() const { return info_; }
  int32_t vocab_size() const { return info_.vocab; }
  int32_t bos_id() const { return info_.bos; }
  int32_t eos_id() const { return info_.eos; }
  int32_t pad_id() const { return info_.pad; }

 protected:
  explicit Tokenizer(TokenizerInfo info) : info_(std::move(info)) {}

 private:
  TokenizerInfo info_;
};

// "bytes", or the path of a SentencePiece .model file. InvalidArgument naming the file when
// it is not a model the library accepts.
absl::StatusOr<std::unique_ptr<Tokenizer>> OpenTokenizer(const std::string& name);

struct SentencePieceTraining {
  std::string output;  // the .model file to write (atomically)
  int vocab_size = 4096;
  std::string model_type = "bpe";  // bpe | unigram
  double character_coverage = 1.0;
  int64_t max_sentences = 2000000;  // sentences sampled for training (0 = all)
  int threads = 0;                  // 0 = every usable core
};
// Trains a SentencePiece model on the sentences `next` yields (one line each; false: no
// more) with the library's trainer, and writes it to options.output; the vocabulary holds
// unk 0, bos 1, eos 2 and no pad (spm_train's defaults). InvalidArgument naming the option
// the library refused (a vocab larger than the corpus supports, ...).
absl::Status TrainSentencePiece(const SentencePieceTraining& options,
                                const std::function<bool(std::string*)>& next);

}  // namespace rackrun::data

#endif  // RACKRUN_DATA_TOKENIZER_H_
