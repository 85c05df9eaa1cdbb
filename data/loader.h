// The training loader: samples of seq_len + 1 tokens drawn from a weighted blend of
// datasets (token_source.h), served as microbatches, never reading a dataset whole.
//
// The sample stream is a pure function of (seed, blend, seq_len): a run's position in it is
// one number (the samples served) plus, to continue in O(1), how many came from each
// dataset; that and the seed are what a checkpoint stores (SavePosition), so a resumed run
// continues with exactly the next samples, whatever its number of ranks or domains.
//
//  - Blend (Megatron-LM's BlendedDataset, its --data-path 0.3 a 0.7 b): weights are
//    normalised; sample n goes to the dataset whose count lags its share most, argmax_d
//    (w_d * max(n, 1) - count_d), the first on ties: after n samples every dataset's count
//    is within one of w_d * n.
//  - Within dataset d of N tokens: windows of seq_len + 1 tokens that overlap by one, W =
//    floor((N - seq_len) / seq_len) of them per epoch. Its k-th sample lies in epoch
//    e = k / W at slot k mod W; each epoch shifts the windows by a random s_e in [0, seq_len)
//    and visits them in a random order (a keyed Feistel permutation of [0, W), so any sample
//    is found in O(1) without a table), both from (seed, d, e). Samples cross document
//    boundaries; unshuffled (validation) loaders start at shift 0 and go in order, with W =
//    floor((N - 1) / seq_len).
//  - A microbatch is `batch` consecutive samples of the stream (the global microbatch).
//    Next() serves rows [first_row, first_row + rows) of it, reading only those windows:
//    each rank of a data-parallel job reads its own share, and every rank advances the
//    stream by the whole microbatch, so all ranks stay at the same position.
//
// Every id read is checked against the vocabulary the loader was created with; an id
// outside it fails Next() naming the dataset and the token's position. Not thread-safe.
#ifndef RACKRUN_DATA_LOADER_H_
#define RACKRUN_DATA_LOADER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "data/token_source.h"
#include "data/tokenizer.h"

namespace rackrun::data {

// One entry of a blend. weight < 0: weigh by token count (a blend given as paths only).
struct BlendEntry {
  double weight = 1;
  std::string path;
};

// One microbatch: `batch` rows of `seq_len` tokens, flattened row-major.
struct Batch {
  int batch = 0;
  int seq_len = 0;
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;  // inputs shifted by one token
  // Flattened indices where a sequence or a document starts: every row start, plus each
  // position whose input is the end-of-document id (the id opens the next document).
  std::vector<int32_t> segment_starts;
};

struct LoaderPosition {
  uint64_t samples = 0;         // samples served (the stream position)
  std::vector<uint64_t> drawn;  // of those, per dataset of the blend
};

struct LoaderOptions {
  int seq_len = 0;
  int batch = 0;  // samples per microbatch (the global microbatch)
  uint64_t seed = 0;
  bool shuffle = true;
  // Ids must lie in [0, vocab); 0 = the datasets' own vocabulary (an error when unknown).
  int32_t vocab = 0;
  // Names the blend in messages ("data.train", "data.blend").
  std::string field = "data.train";
};

class Loader {
 public:
  // Opens every dataset of `blend`. All datasets must come from one tokenizer (else an
  // InvalidArgument naming both) and hold at least 2 windows. (Whether the model's
  // vocabulary holds the data's is the caller's question: runtime/job_data.h asks it.)
  static absl::StatusOr<std::unique_ptr<Loader>> Create(const std::vector<BlendEntry>& blend,
                                                        const LoaderOptions& options);

  // Rows [first_row, first_row + rows) of the next microbatch into `out` (its buffers are
  // reused); the stream advances by the whole microbatch either way.
  absl::Status Next(int first_row, int rows, Batch& out);
  absl::Status Next(Batch& out) { return Next(0, options_.batch, out); }

  const LoaderPosition& position() const { return position_; }
  absl::Status Restore(const LoaderPosition& position);
  // The position with the blend and the data seed it belongs to, as JSON (a checkpoint
  // section), and back: restoring adopts the recorded seed (the stream continues the
  // checkpoint's run); a position recorded for other data (other datasets, sizes or
  // weights) or another seq_len is refused naming both.
  std::string SavePosition() const;
  absl::Status RestorePosition(std::string_view json);

  // Where sample `n` of the stream comes from (dataset index, token offset of its window),
  // given the per-dataset draws before it; advances `drawn`. Exposed for tests.
  struct Draw {
    size_t dataset = 0;
    int64_t start = 0;
  };
  Draw DrawAt(uint64_t n, std::vector<uint64_t>& drawn) const;

  // The data: its tokenizer (kind "unknown" when no dataset recorded one), its vocabulary
  // (0 when unknown), its end-of-document id, tokens and the blend's unigram entropy (the
  // weighted mean of the datasets'; < 0 when one is unknown).
  const TokenizerInfo& tokenizer() const { return tokenizer_; }
  int32_t vocab() const { return tokenizer_.vocab; }
  int32_t end_of_document() const { return end_of_document_; }
  int64_t tokens() const;
  double unigram_entropy() const;
  int64_t windows_per_epoch() const;  // summed over the datasets
  size_t datasets() const { return sources_.size(); }
  const TokenSource& source(size_t i) const { return *sources_[i]; }
  double weight(size_t i) const { return weights_[i]; }  // normalised
  std::string Describe() const;  // "2 datasets (0.3 a, 0.7 b), 123456 tokens"

 private:
  Loader() = default;
  int64_t WindowStart(size_t d, uint64_t k) const;

  LoaderOptions options_;
  std::vector<std::unique_ptr<TokenSource>> sources_;
  std::vector<double> weights_;
  std::vector<int64_t> windows_;
  TokenizerInfo tokenizer_;
  int32_t end_of_document_ = -1;
  LoaderPosition position_;
  std::vector<int32_t> window_;  // seq_len + 1 ids
};

}  // namespace rackrun::data

#endif  // RACKRUN_DATA_LOADER_H_
