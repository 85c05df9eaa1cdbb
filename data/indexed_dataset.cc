#include "data/indexed_dataset.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "nlohmann/json.hpp"

namespace rackrun::data {
namespace {

constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kIndexHeaderBytes = 9 + 8 + 1 + 8 + 8;
constexpr size_t kWriteChunk = size_t{1} << 20;

// This runtime runs on little-endian hosts only (as the checkpoints do): values are
// copied as they lie, through memcpy because the .idx arrays start at offset 34.
template <typename T>
T Load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void Append(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

}  // namespace

size_t MegatronDTypeBytes(uint8_t code) {
  switch (code) {
    case 1:
    case 2:
      return 1;
    case 3:
    case 8:
      return 2;
    case 4:
    case 7:
      return 4;
    case 5:
    case 6:
      return 8;
    default:
      return 0;
  }
}

const char* MegatronDTypeName(uint8_t code) {
  constexpr const char* kNames[] = {"unknown", "uint8",   "int8",    "int16", "int32",
                                    "int64",   "float64", "float32", "uint16"};
  return code < std::size(kNames) ? kNames[code] : kNames[0];
}

uint8_t MegatronDTypeForVocab(int64_t vocab) {
  return vocab < 65500 ? kMegatronUint16 : kMegatronInt32;
}

std::string DatasetPrefix(const std::string& path) {
  if (absl::EndsWith(path, ".bin") || absl::EndsWith(path, ".idx")) {
    return path.substr(0, path.size() - 4);
  }
  return path;
}

std::string DatasetInfoPath(const std::string& prefix) { return prefix + ".meta.json"; }

double UnigramEntropy(std::span<const int64_t> counts) {
  double n = 0;
  for (const int64_t c : counts) n += static_cast<double>(c);
  if (n == 0) return 0;
  double h = 0;
  for (const int64_t c : counts) {
    if (c > 0) {
      const double p = static_cast<double>(c) / n;
      h -= p * std::log(p);
    }
  }
  return h;
}

std::string DatasetInfo::ToJson() const {
  nlohmann::json j = {{"format", "rackrun dataset record"},
                      {"version", 1},
                      {"tokenizer", nlohmann::json::parse(tokenizer.ToJson())},
                      {"end_of_document", end_of_document},
                      {"documents", documents},
                      {"tokens", tokens},
                      {"unigram_entropy", unigram_entropy},
                      {"sources", sources}};
  return j.dump(2) + "\n";
}

absl::StatusOr<DatasetInfo> DatasetInfo::FromJson(std::string_view json,
                                                  const std::string& origin) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset record '", origin, "' is not valid: ", why,
                     "; remove it (the job spec must then give model.vocab) or remake the data"));
  };
  if (!j.is_object() || !j.contains("tokenizer")) return bad("no \"tokenizer\"");
  absl::StatusOr<TokenizerInfo> tokenizer = TokenizerInfo::FromJson(j["tokenizer"].dump(), origin);
  if (!tokenizer.ok()) return bad(tokenizer.status().message());
  DatasetInfo info;
  info.tokenizer = *std::move(tokenizer);
  if (j.contains("end_of_document") && j["end_of_document"].is_number_integer()) {
    info.end_of_document = j["end_of_document"].get<int32_t>();
  }
  if (info.end_of_document < -1 || info.end_of_document >= info.tokenizer.vocab) {
    return bad(absl::StrCat("end_of_document ", info.end_of_document, " is outside the vocab ",
                            info.tokenizer.vocab));
  }
  if (j.contains("documents") && j["documents"].is_number_integer()) {
    info.documents = j["documents"].get<int64_t>();
  }
  if (j.contains("tokens") && j["tokens"].is_number_integer())
    info.tokens = j["tokens"].get<int64_t>();
  if (j.contains("unigram_entropy") && j["unigram_entropy"].is_number()) {
    info.unigram_entropy = j["unigram_entropy"].get<double>();
  }
  if (j.contains("sources") && j["sources"].is_array()) {
    for (const nlohmann::json& s : j["sources"]) {
      if (s.is_string()) info.sources.push_back(s.get<std::string>());
    }
  }
  return info;
}

absl::StatusOr<IndexedDataset> IndexedDataset::Open(const std::string& path) {
  IndexedDataset d;
  d.prefix_ = DatasetPrefix(path);
  const std::string idx_path = d.prefix_ + ".idx", bin_path = d.prefix_ + ".bin";
  absl::StatusOr<MappedFile> index = MappedFile::Open(idx_path, "dataset index");
  if (!index.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index.status().message(),
                     "; a Megatron dataset is PREFIX.bin + PREFIX.idx (make one with "
                     "`rackrun data --input TEXT --output DIR`)"));
  }
  d.index_ = *std::move(index);
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset index '", idx_path, "' is not valid: ", why));
  };
  const std::string_view idx = d.index_.bytes();
  if (idx.size() < kIndexHeaderBytes) return bad("shorter than its 34-byte header");
  if (std::memcmp(idx.data(), kIndexMagic, sizeof(kIndexMagic)) != 0) {
    return bad("wrong magic (not a Megatron MMIDIDX index)");
  }
  const uint64_t version = Load<uint64_t>(idx.data() + 9);
  if (version != 1) return bad(absl::StrCat("version ", version, ", expected 1"));
  d.dtype_ = static_cast<uint8_t>(idx[17]);
  d.element_ = MegatronDTypeBytes(d.dtype_);
  if (d.element_ == 0) return bad(absl::StrCat("unknown dtype code ", int{d.dtype_}));
  if (d.dtype_ == 6 || d.dtype_ == 7) {
    return bad(absl::StrCat("dtype ", MegatronDTypeName(d.dtype_), " holds no token ids"));
  }
  const uint64_t s = Load<uint64_t>(idx.data() + 18);
  const uint64_t entries = Load<uint64_t>(idx.data() + 26);
  const uint64_t body = idx.size() - kIndexHeaderBytes;
  // Bounded before any product: each count alone must fit the file.
  if (s > body / 12 || entries == 0 || entries > body / 8 || 12 * s + 8 * entries != body) {
    return bad(absl::StrCat("header says ", s, " sequences and ", entries,
                            " document-index entries, which need ", 12 * s + 8 * entries,
                            " bytes after the header, but the file has ", body, " (truncated?)"));
  }
  d.sequences_ = static_cast<int64_t>(s);
  d.documents_ = static_cast<int64_t>(entries) - 1;

  absl::StatusOr<MappedFile> bin = MappedFile::Open(bin_path, "dataset tokens");
  if (!bin.ok()) return absl::InvalidArgumentError(bin.status().message());
  d.bin_ = *std::move(bin);
  // The whole index, once: contiguous sequences filling the .bin, a rising document index.
  uint64_t expected = 0;
  for (int64_t i = 0; i < d.sequences_; ++i) {
    const int32_t length = d.sequence_length(i);
    const int64_t pointer = Load<int64_t>(idx.data() + kIndexHeaderBytes + 4 * s + 8 * i);
    if (length < 0) return bad(absl::StrCat("sequence ", i, " has length ", length));
    if (pointer < 0 || static_cast<uint64_t>(pointer) != expected) {
      return bad(absl::StrCat("sequence ", i, " starts at byte ", pointer,
                              " of the .bin, expected ", expected,
                              " (sequences must be contiguous, in order)"));
    }
    expected += static_cast<uint64_t>(length) * d.element_;
  }
  if (expected != d.bin_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset '", bin_path, "' has ", d.bin_.size(), " bytes but its index describes ", expected,
        " (truncated, or the .bin and .idx are from different runs)"));
  }
  d.tokens_ = static_cast<int64_t>(expected / d.element_);
  int64_t previous = 0;
  for (int64_t i = 0; i <= d.documents_; ++i) {
    const int64_t v = d.document_index(i);
    if ((i == 0 && v != 0) || v < previous || v > d.sequences_ ||
        (i == d.documents_ && v != d.sequences_)) {
      return bad(absl::StrCat("document index entry ", i, " is ", v,
                              " (entries must rise from 0 to the sequence count ", d.sequences_,
                              ")"));
    }
    previous = v;
  }

  const std::string info_path = DatasetInfoPath(d.prefix_);
  std::error_code ec;
  if (std::filesystem::exists(info_path, ec)) {
    absl::StatusOr<MappedFile> info_file =
        MappedFile::Open(info_path, "dataset record", MappedFile::Access::kSequential);
    if (!info_file.ok()) return info_file.status();
    absl::StatusOr<DatasetInfo> info = DatasetInfo::FromJson(info_file->bytes(), info_path);
    if (!info.ok()) return info.status();
    if (info->tokens != d.tokens_ || info->documents != d.documents_) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset record '", info_path, "' says ", info->documents, " documents and ",
                       info->tokens, " tokens but the dataset holds ", d.documents_, " and ",
                       d.tokens_, "; it belongs to other data: remove it or remake the dataset"));
    }
    d.info_ = *std::move(info);
  }
  return d;
}

int32_t IndexedDataset::sequence_length(int64_t i) const {
  return Load<int32_t>(index_.bytes().data() + kIndexHeaderBytes + 4 * i);
}

int64_t IndexedDataset::sequence_start(int64_t i) const {
  const size_t s = static_cast<size_t>(sequences_);
  return Load<int64_t>(index_.bytes().data() + kIndexHeaderBytes + 4 * s + 8 * i) /
         static_cast<int64_t>(element_);
}

int64_t IndexedDataset::document_index(int64_t i) const {
  const size_t s = static_cast<size_t>(sequences_);
  return Load<int64_t>(index_.bytes().data() + kIndexHeaderBytes + 12 * s + 8 * i);
}

void IndexedDataset::Read(int64_t begin, int64_t count, int32_t* out) const {
  const char* p = bin_.bytes().data() + static_cast<size_t>(begin) * element_;
  const auto convert = [&]<typename T>(T) {
    for (int64_t i = 0; i < count; ++i) {
      const T v = Load<T>(p + sizeof(T) * static_cast<size_t>(i));
      if constexpr (sizeof(T) == 8) {
        out[i] = v < 0 || v > std::numeric_limits<int32_t>::max() ? -1 : static_cast<int32_t>(v);
      } else {
        out[i] = static_cast<int32_t>(v);
      }
    }
  };
  switch (dtype_) {
    case 1:
      convert(uint8_t{});
      break;
    case 2:
      convert(int8_t{});
      break;
    case 3:
      convert(int16_t{});
      break;
    case 4:
      convert(int32_t{});
      break;
    case 5:
      convert(int64_t{});
      break;
    case 8:
      convert(uint16_t{});
      break;
    default:
      std::fill(out, out + count, -1);
  }
}

// The temporary files of a writer.
struct IndexedDatasetWriter::Files {
  base::AtomicFileWriter bin;
  std::string lengths_path;
  int lengths_fd = -1;
  ~Files() {
    if (lengths_fd >= 0) ::close(lengths_fd);
    if (!lengths_path.empty()) ::unlink(lengths_path.c_str());
  }
};

absl::StatusOr<IndexedDatasetWriter> IndexedDatasetWriter::Create(const std::string& prefix,
                                                                  uint8_t dtype, int32_t vocab) {
  if (dtype != kMegatronUint16 && dtype != kMegatronInt32) {
    return absl::InvalidArgumentError(
        absl::StrCat("the writer writes uint16 or int32 ids, not ", MegatronDTypeName(dtype)));
  }
  if (vocab <= 0 || (dtype == kMegatronUint16 && vocab > 65536)) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab ", vocab, " does not fit dtype ", MegatronDTypeName(dtype)));
  }
  absl::StatusOr<base::AtomicFileWriter> bin = base::AtomicFileWriter::Open(prefix + ".bin");
  if (!bin.ok()) return bin.status();
  IndexedDatasetWriter w;
  w.prefix_ = prefix;
  w.dtype_ = dtype;
  w.vocab_ = vocab;
  w.files_ = std::unique_ptr<Files>(new Files{*std::move(bin), "", -1});
  w.files_->lengths_path = base::TemporaryPath(prefix + ".lengths");
  w.files_->lengths_fd =
      ::open(w.files_->lengths_path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (w.files_->lengths_fd < 0) {
    absl::Status s = base::PosixError("cannot create", w.files_->lengths_path);
    w.files_->lengths_path.clear();
    return s;
  }
  w.counts_.assign(static_cast<size_t>(vocab), 0);
  return w;
}

IndexedDatasetWriter::IndexedDatasetWriter(IndexedDatasetWriter&&) noexcept = default;
IndexedDatasetWriter& IndexedDatasetWriter::operator=(IndexedDatasetWriter&&) noexcept = default;
IndexedDatasetWriter::~IndexedDatasetWriter() = default;

absl::Status IndexedDatasetWriter::AddDocument(std::span<const int32_t> tokens) {
  if (files_ == nullptr) return absl::FailedPreconditionError("the dataset writer is finished");
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("a document of ", tokens.size(), " tokens is longer than an .idx can say"));
  }
  for (const int32_t t : tokens) {
    if (t < 0 || t >= vocab_) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", t, " is outside the vocabulary [0, ", vocab_, ")"));
    }
    ++counts_[static_cast<size_t>(t)];
    if (dtype_ == kMegatronUint16) {
      Append(buffer_, static_cast<uint16_t>(t));
    } else {
      Append(buffer_, t);
    }
  }
  tokens_ += static_cast<int64_t>(tokens.size());
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  if (buffer_.size() >= kWriteChunk) {
    if (absl::Status s = files_->bin.Append(buffer_); !s.ok()) return s;
    buffer_.clear();
  }
  if (lengths_.size() * sizeof(int32_t) >= kWriteChunk) return FlushLengths();
  return absl::OkStatus();
}

absl::Status IndexedDatasetWriter::FlushLengths() {
  const char* p = reinterpret_cast<const char*>(lengths_.data());
  size_t left = lengths_.size() * sizeof(int32_t);
  while (left > 0) {
    const ssize_t n = ::write(files_->lengths_fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return base::PosixError("cannot write", files_->lengths_path);
    p += n;
    left -= static_cast<size_t>(n);
  }
  lengths_written_ += lengths_.size();
  lengths_.clear();
  return absl::OkStatus();
}

absl::Status IndexedDatasetWriter::Finish(DatasetInfo info) {
  if (files_ == nullptr) return absl::FailedPreconditionError("the dataset writer is finished");
  if (absl::Status s = files_->bin.Append(buffer_); !s.ok()) return s;
  buffer_.clear();
  if (absl::Status s = FlushLengths(); !s.ok()) return s;
  const uint64_t s_count = lengths_written_;
  absl::StatusOr<base::AtomicFileWriter> idx = base::AtomicFileWriter::Open(prefix_ + ".idx");
  if (!idx.ok()) return idx.status();
  std::string out(kIndexMagic, sizeof(kIndexMagic));
  Append<uint64_t>(out, 1);
  out.push_back(static_cast<char>(dtype_));
  Append<uint64_t>(out, s_count);
  Append<uint64_t>(out, s_count + 1);
  // Lengths, copied from the scratch file; then pointers recomputed from them (twice
  // through the file keeps memory flat).
  const auto pass = [&](bool pointers) -> absl::Status {
    if (::lseek(files_->lengths_fd, 0, SEEK_SET) != 0) {
      return base::PosixError("cannot rewind", files_->lengths_path);
    }
    std::vector<int32_t> chunk(kWriteChunk / sizeof(int32_t));
    uint64_t done = 0;
    int64_t offset = 0;
    const int64_t element = static_cast<int64_t>(MegatronDTypeBytes(dtype_));
    while (done < s_count) {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(chunk.size(), s_count - done));
      size_t got = 0;
      while (got < want * sizeof(int32_t)) {
        const ssize_t n = ::read(files_->lengths_fd, reinterpret_cast<char*>(chunk.data()) + got,
                                 want * sizeof(int32_t) - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return base::PosixError("cannot read back", files_->lengths_path);
        got += static_cast<size_t>(n);
      }
      for (size_t i = 0; i < want; ++i) {
        if (pointers) {
          Append<int64_t>(out, offset);
          offset += chunk[i] * element;
        } else {
          Append<int32_t>(out, chunk[i]);
        }
      }
      done += want;
      if (out.size() >= kWriteChunk) {
        if (absl::Status st = idx->Append(out); !st.ok()) return st;
        out.clear();
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status st = pass(false); !st.ok()) return st;
  if (absl::Status st = pass(true); !st.ok()) return st;
  for (uint64_t i = 0; i <= s_count; ++i) {
    Append<int64_t>(out, static_cast<int64_t>(i));
    if (out.size() >= kWriteChunk) {
      if (absl::Status st = idx->Append(out); !st.ok()) return st;
      out.clear();
    }
  }
  if (absl::Status st = idx->Append(out); !st.ok()) return st;

  info.documents = static_cast<int64_t>(s_count);
  info.tokens = tokens_;
  info.unigram_entropy = UnigramEntropy(counts_);
  // An old index goes first: from here until the new one is in place the dataset has no
  // .idx, so no reader takes a new .bin with an old index.
  if (::unlink((prefix_ + ".idx").c_str()) != 0 && errno != ENOENT) {
    return base::PosixError("cannot remove the old index", prefix_ + ".idx");
  }
  if (absl::Status st = files_->bin.Commit(); !st.ok()) return st;
  if (absl::Status st = base::WriteFileAtomically(DatasetInfoPath(prefix_), info.ToJson());
      !st.ok()) {
    return st;
  }
  if (absl::Status st = idx->Commit(); !st.ok()) return st;
  files_.reset();
  return absl::OkStatus();
}

}  // namespace rackrun::data
