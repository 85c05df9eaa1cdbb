#include "data/token_source.h"

#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "data/token_file.h"

namespace rackrun::data {

std::vector<std::string> DatasetFiles(const std::string& path) {
  std::error_code ec;
  const bool megatron_file = path.ends_with(".bin") || path.ends_with(".idx");
  // A file at the path itself (a FIFO or a device too, so that its open names what it is),
  // not a folder: the dataset is that file; else a prefix.
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  const bool a_file = std::filesystem::exists(st) && !std::filesystem::is_directory(st);
  if ((a_file || path.ends_with(".tokens")) && !megatron_file) return {path};
  const std::string prefix = DatasetPrefix(path);
  return {prefix + ".idx", prefix + ".bin"};
}

absl::StatusOr<std::unique_ptr<TokenSource>> TokenSource::Open(const std::string& path) {
  std::unique_ptr<TokenSource> s(new TokenSource());
  s->path_ = path;
  // A .tokens file is one file starting with its magic; anything else is a dataset prefix.
  absl::StatusOr<MappedFile> file = MappedFile::Open(path, "token file");
  // Missing is a prefix's normal case; a FIFO, a device or a path outside a worker's roots
  // is this dataset's error.
  if (!file.ok() &&
      (path.ends_with(".tokens") || (file.status().code() != absl::StatusCode::kNotFound &&
                                     !std::filesystem::is_directory(path)))) {
    return file.status();
  }
  if (file.ok() && LooksLikeTokenFile(file->bytes())) {
    absl::StatusOr<TokenFileHeader> h = ParseTokenFileHeader(file->bytes(), path);
    if (!h.ok()) return h.status();
    s->token_file_ = *std::move(file);
    s->token_bytes_ = h->dtype;
    s->tokens_ = static_cast<int64_t>(h->count);
    s->end_of_document_ = h->end_of_document;
    const bool bytes = h->vocab == kByteVocab && h->end_of_document == kByteEndOfDocument;
    s->tokenizer_ = TokenizerInfo{.kind = bytes ? "bytes" : "unknown",
                                  .vocab = static_cast<int32_t>(h->vocab),
                                  .bos = h->end_of_document,
                                  .eos = h->end_of_document};
    return s;
  }
  absl::StatusOr<IndexedDataset> dataset = IndexedDataset::Open(path);
  if (!dataset.ok()) {
    if (file.ok() && !path.ends_with(".bin") && !path.ends_with(".idx")) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path,
                       "' is neither a token file (no RKRTOKNS magic) nor a Megatron dataset "
                       "prefix: ",
                       dataset.status().message()));
    }
    return dataset.status();
  }
  s->dataset_.emplace(*std::move(dataset));
  s->tokens_ = s->dataset_->tokens();
  if (const std::optional<DatasetInfo>& info = s->dataset_->info(); info.has_value()) {
    s->tokenizer_ = info->tokenizer;
    s->end_of_document_ = info->end_of_document;
    s->unigram_entropy_ = info->unigram_entropy;
  } else {
    s->tokenizer_ = TokenizerInfo{.kind = "unknown"};
  }
  return s;
}

void TokenSource::Read(int64_t begin, int64_t count, int32_t* out) const {
  if (dataset_.has_value()) {
    dataset_->Read(begin, count, out);
    return;
  }
  const char* p = token_file_.bytes().data() + kTokenFileHeaderBytes +
                  static_cast<size_t>(begin) * token_bytes_;
  for (int64_t i = 0; i < count; ++i) {
    if (token_bytes_ == 2) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      out[i] = v;
    } else {
      uint32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      out[i] = v > 0x7fffffffu ? -1 : static_cast<int32_t>(v);
    }
  }
}

}  // namespace rackrun::data
