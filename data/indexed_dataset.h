// Megatron-LM indexed datasets (`preprocess_data.py`'s output, megatron/core/datasets/
// indexed_dataset.py): a `.bin` of concatenated token ids and an `.idx` describing it, read
// memory-mapped and written streaming, plus rackrun's record of how the data was made.
//
// `.idx` layout (docs/design.md section 8), all little-endian:
//   char[9]  "MMIDIDX\0\0"
//   uint64   version = 1
//   uint8    dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
//            8 uint16
//   uint64   S = number of sequences
//   uint64   D = number of document-index entries (documents + 1)
//   int32    sequence lengths in tokens [S]
//   int64    byte offset of each sequence in the .bin [S]
//   int64    document index [D]: 0, then the sequence index where each document ends; the
//            last entry is S
// A dataset is named by its prefix: `a` means `a.bin` + `a.idx` (a path ending in .bin or
// .idx names the same dataset).
//
// rackrun's record (`PREFIX.meta.json`, DatasetInfo): the tokenizer (TokenizerInfo), the
// end-of-document id, counts and the unigram entropy. Megatron ignores it; data prepared by
// Megatron has none, and then the job spec must say the vocabulary (model.vocab).
//
// Every document written here is one sequence: its tokens followed by the end-of-document
// id (Megatron's --append-eod).
#ifndef RACKRUN_DATA_INDEXED_DATASET_H_
#define RACKRUN_DATA_INDEXED_DATASET_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "data/mapped_file.h"
#include "data/tokenizer.h"

namespace rackrun::data {

// Bytes per element of a Megatron dtype code; 0 for an unknown code.
size_t MegatronDTypeBytes(uint8_t code);
// The code's name ("uint16"), or "unknown".
const char* MegatronDTypeName(uint8_t code);
inline constexpr uint8_t kMegatronUint16 = 8;
inline constexpr uint8_t kMegatronInt32 = 4;
// Megatron's DType.optimal_dtype: uint16 below a vocabulary of 65500, else int32.
uint8_t MegatronDTypeForVocab(int64_t vocab);

// "a", "a.bin", "a.idx" -> "a".
std::string DatasetPrefix(const std::string& path);
std::string DatasetInfoPath(const std::string& prefix);  // PREFIX.meta.json

// What rackrun knows about a dataset it made.
struct DatasetInfo {
  TokenizerInfo tokenizer{};
  int32_t end_of_document = -1;  // -1: unknown
  int64_t documents = 0;
  int64_t tokens = 0;
  double unigram_entropy = -1;  // nats per token; < 0: unknown
  std::vector<std::string> sources{};

  std::string ToJson() const;
  static absl::StatusOr<DatasetInfo> FromJson(std::string_view json, const std::string& origin);
};

// Entropy of the empirical unigram distribution of `counts` (counts[id] = occurrences), in
// nats per token: the loss of the best model that ignores context.
double UnigramEntropy(std::span<const int64_t> counts);

// A dataset opened for reading: both files mapped, the index checked whole at Open (every
// length non-negative, sequences contiguous in the .bin from offset 0 and filling it, the
// document index rising from 0 to S), so that afterwards the .bin is one token stream that
// Read() addresses by token position. Movable; reads are thread-safe.
class IndexedDataset {
 public:
  // InvalidArgument naming the file and what is wrong (magic, version, dtype, sizes, ...).
  static absl::StatusOr<IndexedDataset> Open(const std::string& path);

  const std::string& prefix() const { return prefix_; }
  uint8_t dtype_code() const { return dtype_; }
  int64_t sequences() const { return sequences_; }
  int64_t documents() const { return documents_; }
  int64_t tokens() const { return tokens_; }
  // Sequence i: its first token's position in the stream and its length.
  int64_t sequence_start(int64_t i) const;
  int32_t sequence_length(int64_t i) const;
  // Document-index entry i (0 <= i <= documents()).
  int64_t document_index(int64_t i) const;
  // The record beside it (PREFIX.meta.json), when there is one.
  const std::optional<DatasetInfo>& info() const { return info_; }

  // Token ids [begin, begin + count) of the stream as int32 (precondition: in range).
  // Values that do not fit an int32 (int64 data) come out as -1 for the caller's range check.
  void Read(int64_t begin, int64_t count, int32_t* out) const;

 private:
  IndexedDataset() = default;
  std::string prefix_;
  MappedFile index_;
  MappedFile bin_;
  uint8_t dtype_ = 0;
  size_t element_ = 0;
  int64_t sequences_ = 0;
  int64_t documents_ = 0;
  int64_t tokens_ = 0;
  std::optional<DatasetInfo> info_;
};

// Writes one dataset, streaming: the .bin as documents arrive, the sequence lengths to a
// scratch file (4 bytes per document, so memory stays flat), the .idx at Finish. Nothing
// appears under the dataset's names before Finish: the files are written under temporary
// names, and Finish first removes an old PREFIX.idx, then renames the .bin, the record and
// last the .idx, so a dataset that has its .idx is complete. Destroyed without a successful
// Finish, it removes its temporaries. Not thread-safe.
class IndexedDatasetWriter {
 public:
  // `vocab` bounds the ids (and sizes the unigram counts).
  static absl::StatusOr<IndexedDatasetWriter> Create(const std::string& prefix, uint8_t dtype,
                                                     int32_t vocab);
  IndexedDatasetWriter(IndexedDatasetWriter&&) noexcept;
  IndexedDatasetWriter& operator=(IndexedDatasetWriter&&) noexcept;
  ~IndexedDatasetWriter();

  // One document (one sequence); ids outside [0, vocab) are refused.
  absl::Status AddDocument(std::span<const int32_t> tokens);
  // Writes the index and `info` (documents, tokens and the unigram entropy filled in here)
  // and renames everything into place.
  absl::Status Finish(DatasetInfo info);

  int64_t documents() const { return static_cast<int64_t>(lengths_written_ + lengths_.size()); }
  int64_t tokens() const { return tokens_; }

 private:
  struct Files;
  IndexedDatasetWriter() = default;
  absl::Status FlushLengths();

  std::string prefix_;
  uint8_t dtype_ = 0;
  int32_t vocab_ = 0;
  std::unique_ptr<Files> files_;
  std::vector<int32_t> lengths_;  // not yet in the scratch file
  uint64_t lengths_written_ = 0;
  int64_t tokens_ = 0;
  std::vector<int64_t> counts_;  // unigram counts
  std::string buffer_;           // .bin bytes not yet written
};

}  // namespace rackrun::data

#endif  // RACKRUN_DATA_INDEXED_DATASET_H_
