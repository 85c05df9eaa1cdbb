// One dataset the loader draws from, whatever its format: a Megatron dataset (PREFIX, or
// PREFIX.bin / PREFIX.idx; indexed_dataset.h) or one of rackrun's older token files
// (`.tokens`, token_file.h), both memory-mapped. Only the pages of the windows read are
// ever touched.
//
// What a source says about itself: its token count, and when it knows them its tokenizer,
// vocabulary, end-of-document id and unigram entropy (a Megatron dataset from rackrun data
// has a record; one from Megatron's preprocess_data.py has none: kind "unknown", vocab 0).
#ifndef RACKRUN_DATA_TOKEN_SOURCE_H_
#define RACKRUN_DATA_TOKEN_SOURCE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/indexed_dataset.h"
#include "data/mapped_file.h"
#include "data/tokenizer.h"

namespace rackrun::data {

// The files the dataset named `path` consists of: `path` itself when it is a regular file
// or ends in .tokens, else (a prefix, or a .bin or .idx named directly) PREFIX.idx and
// PREFIX.bin. For whoever checks that a job's data can be read before it starts.
std::vector<std::string> DatasetFiles(const std::string& path);

class TokenSource {
 public:
  // A `.tokens` file (by its magic), else a Megatron dataset. Errors name the path.
  static absl::StatusOr<std::unique_ptr<TokenSource>> Open(const std::string& path);

  const std::string& path() const { return path_; }
  int64_t tokens() const { return tokens_; }
  const TokenizerInfo& tokenizer() const { return tokenizer_; }  // vocab 0: unknown
  int32_t end_of_document() const { return end_of_document_; }   // -1: none or unknown
  double unigram_entropy() const { return unigram_entropy_; }    // < 0: unknown
  std::string_view format() const { return dataset_ ? "megatron" : "tokens"; }

  // Ids [begin, begin + count) as int32 (precondition: in range; see IndexedDataset::Read).
  void Read(int64_t begin, int64_t count, int32_t* out) const;

 private:
  TokenSource() = default;
  std::string path_;
  int64_t tokens_ = 0;
  TokenizerInfo tokenizer_;
  int32_t end_of_document_ = -1;
  double unigram_entropy_ = -1;
  std::optional<IndexedDataset> dataset_;
  MappedFile token_file_;  // a .tokens file
  uint32_t token_bytes_ = 0;
};

}  // namespace rackrun::data

#endif  // RACKRUN_DATA_TOKEN_SOURCE_H_
