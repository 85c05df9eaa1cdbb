// `rackrun data`'s work: one input (text file, folder or JSON Lines, corpus.h) -> one
// Megatron dataset (indexed_dataset.h) of its training documents, and with a validation
// fraction F > 0 a second one of its validation documents.
//
// Validation split, a pure function of the document order: every round(1/F)-th document
// (the last of each group; at least every 2nd) goes to validation. An input of a single
// document gives validation the last F of its bytes (cut at a line break within 1% when
// there is one); when no document fell to validation, the last document goes there.
//
// Tokenizing runs on `threads` threads: the calling thread reads documents into batches
// (about 1 MiB of text each), workers tokenize batches (every document followed by the
// tokenizer's EOS id), and a writer thread appends them in input order. At most
// 2 x threads + 2 batches exist at once, so memory is bounded by that plus the largest
// document, whatever the input's size. A bad input (corpus.h's messages) or a failed write
// stops everything and leaves no dataset under the output names (IndexedDatasetWriter).
#ifndef RACKRUN_DATA_PREPARE_H_
#define RACKRUN_DATA_PREPARE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "data/corpus.h"
#include "data/indexed_dataset.h"
#include "data/tokenizer.h"

namespace rackrun::data {

struct PrepareProgress {
  int64_t bytes_read = 0;
  int64_t total_bytes = 0;
  int64_t documents = 0;
  int64_t tokens = 0;
  double seconds = 0;
};

struct PrepareOptions {
  const Tokenizer* tokenizer = nullptr;  // not owned
  CorpusOptions corpus{};
  double val_fraction = 0;  // [0, 0.5]
  int threads = 0;          // 0 = every usable core
  // Called on the reading thread about every 0.2 s and once at the end.
  std::function<void(const PrepareProgress&)> on_progress{};
};

struct PreparedDataset {
  std::string prefix;
  DatasetInfo info;
};

struct PrepareResult {
  PreparedDataset train;
  std::optional<PreparedDataset> validation;  // when val_fraction > 0
  int64_t bytes = 0;                          // of text read
  int64_t skipped_documents = 0;              // by --invalid-utf8 skip
  double seconds = 0;
  int threads = 0;
};

// Writes `prefix` (training) and, with val_fraction > 0, `val_prefix` from `input`.
absl::StatusOr<PrepareResult> PrepareDataset(const std::string& input, const std::string& prefix,
                                             const std::string& val_prefix,
                                             const PrepareOptions& options);

}  // namespace rackrun::data

#endif  // RACKRUN_DATA_PREPARE_H_
