// Training data: token files, the byte-level tokenizer, and the deterministic loader.
//
// Token file format (docs/design.md section 8.4), all integers little-endian:
//   offset  0  char[8]  magic "RKRTOKNS"
//   offset  8  uint32   version (1)
//   offset 12  uint32   dtype: bytes per token id, 2 (uint16) or 4 (uint32)
//   offset 16  uint64   count: number of token ids that follow
//   offset 24  uint32   vocab: ids are < vocab
//   offset 28  int32    end-of-document id, or -1 when the file has no document marks
//   offset 32  count token ids of `dtype` bytes each
// A reader refuses a file whose size is not exactly 32 + count * dtype, and a vocab
// above kMaxTokenVocab: every size in the header is bounded before it is used.
//
// Byte-level tokenizer: ids 0..255 are the bytes of the UTF-8 text; id 256 is the
// end-of-document mark (vocab 257). The mark is written BEFORE every document, so it
// also works as a beginning-of-sequence token: a document's first byte is predicted
// from the mark, and the previous document's last byte predicts the mark.
#ifndef RACKRUN_RUNTIME_DATA_H_
#define RACKRUN_RUNTIME_DATA_H_

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rackrun::runtime {

inline constexpr int kByteVocab = 257;
inline constexpr int32_t kByteEndOfDocument = 256;
// Largest vocabulary a token file may declare: 2^24, 64x the largest tokenizers in use
// (~256k ids). A header above it is refused before anything is sized by it (the model's
// embedding and the unigram counts are vocab-sized).
inline constexpr uint32_t kMaxTokenVocab = uint32_t{1} << 24;

struct TokenFile {
  uint32_t vocab = 0;
  int32_t end_of_document = -1;  // -1: no document marks
  std::vector<int32_t> tokens;
};

// Writes `file` to `path` (dtype uint16 when vocab <= 65536, else uint32), atomically:
// temp file, fsync, rename. Fails if a token is outside [0, vocab).
absl::Status WriteTokenFile(const std::string& path, const TokenFile& file);
// Reads a token file; a wrong magic, version, dtype, size, vocab (0 or above
// kMaxTokenVocab) or out-of-range id is an InvalidArgument naming the file.
absl::StatusOr<TokenFile> ReadTokenFile(const std::string& path);
// The same checks on a file's bytes already in memory; `path` only names it in errors.
absl::StatusOr<TokenFile> ParseTokenFile(std::string_view bytes, const std::string& path);

// Byte-level tokenization of documents: [EOD, bytes of doc 0, EOD, bytes of doc 1, ...].
std::vector<int32_t> ByteTokenize(std::span<const std::string> documents);
// Inverse for display: bytes back to text; the mark becomes "\n<|eod|>\n".
std::string ByteDetokenize(std::span<const int32_t> tokens);

// Splits a text into documents at lines that consist of a single form feed ("\f").
std::vector<std::string> SplitDocuments(std::string_view text);

// Splits documents into train and validation sets: every round(1 / fraction)-th
// document (starting with the last one of each group) goes to validation. With a single
// document, the last `fraction` of its bytes (cut at a newline when one is near) becomes
// the validation document. fraction must lie in [0, 0.5].
struct DocumentSplit {
  std::vector<std::string> train;
  std::vector<std::string> validation;
};
absl::StatusOr<DocumentSplit> SplitTrainValidation(std::vector<std::string> documents,
                                                   double fraction);

// Entropy of the empirical unigram distribution of `tokens`, in nats per token: the loss
// of the best model that ignores context, the bar a language model must clearly beat.
double UnigramEntropy(std::span<const int32_t> tokens, int vocab);

// Where a loader is in its stream. Together with the seed and the token file this is
// the loader's whole state: restoring it reproduces the following batches exactly.
struct LoaderPosition {
  uint64_t epoch = 0;
  uint64_t cursor = 0;                  // windows already served in this epoch
  std::array<uint64_t, 4> epoch_rng{};  // shuffle RNG state at the start of this epoch
};

// One microbatch: `batch` rows of `seq_len` tokens, flattened row-major.
struct Batch {
  int batch = 0;
  int seq_len = 0;
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;  // inputs shifted by one token
  // Flattened indices where a sequence or a document starts: every row start, plus each
  // position whose input is the end-of-document mark (the mark opens the next document).
  std::vector<int32_t> segment_starts;
};

// Serves batches of windows of a token stream. The stream is cut into windows of
// seq_len + 1 tokens (neighbours overlap by one token); each epoch starts at a random
// shift in [0, seq_len) and visits the windows in a random order (xoshiro256**, seeded
// from `seed`), so epochs differ but every run with the same seed sees the same batches.
// Not thread-safe.
class WindowLoader {
 public:
  // `shuffle` = false serves windows in file order from shift 0 every epoch (validation).
  static absl::StatusOr<WindowLoader> Create(std::vector<int32_t> tokens, int32_t end_of_document,
                                             int seq_len, int batch, uint64_t seed, bool shuffle);

  // Fills `out` with the next microbatch (reusing its buffers).
  void Next(Batch& out);

  LoaderPosition position() const { return position_; }
  // Restores a position saved by position(); the next Next() continues from there.
  absl::Status Restore(const LoaderPosition& position);

  int64_t windows_per_epoch() const { return static_cast<int64_t>(order_.size()); }
  int64_t tokens() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  WindowLoader(std::vector<int32_t> tokens, int32_t end_of_document, int seq_len, int batch,
               bool shuffle);
  // Derives shift_ and order_ from position_.epoch_rng (no other state is consulted).
  void StartEpoch();

  std::vector<int32_t> tokens_;
  int32_t end_of_document_;
  int seq_len_;
  int batch_;
  bool shuffle_;
  LoaderPosition position_;
  int64_t shift_ = 0;
  std::array<uint64_t, 4> next_epoch_rng_{};  // RNG state after this epoch's draws
  std::vector<int64_t> order_;  // window start offsets of this epoch, in serving order
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_DATA_H_
