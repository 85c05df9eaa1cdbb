#include "runtime/data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/random.h"
#include "runtime/checkpoint.h"

namespace rackrun::runtime {
namespace {

constexpr char kMagic[8] = {'R', 'K', 'R', 'T', 'O', 'K', 'N', 'S'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 32;

template <typename U>
void PutLe(std::string& out, U value) {
  for (size_t i = 0; i < sizeof(U); ++i) {
    out.push_back(static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff));
  }
}

template <typename U>
U GetLe(const unsigned char* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(U); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<U>(v);
}


}  // namespace

absl::Status WriteTokenFile(const std::string& path, const TokenFile& file) {
  if (file.vocab == 0) return absl::InvalidArgumentError("token file vocab must be positive");
  if (file.vocab > kMaxTokenVocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file vocab ", file.vocab, " is above the limit of ", kMaxTokenVocab));
  }
  const uint32_t dtype = file.vocab <= 65536 ? 2 : 4;
  std::string bytes;
  bytes.reserve(kHeaderBytes + file.tokens.size() * dtype);
  bytes.append(kMagic, sizeof(kMagic));
  PutLe<uint32_t>(bytes, kVersion);
  PutLe<uint32_t>(bytes, dtype);
  PutLe<uint64_t>(bytes, file.tokens.size());
  PutLe<uint32_t>(bytes, file.vocab);
  PutLe<uint32_t>(bytes, static_cast<uint32_t>(file.end_of_document));
  for (size_t i = 0; i < file.tokens.size(); ++i) {
    const int32_t t = file.tokens[i];
    if (t < 0 || static_cast<uint32_t>(t) >= file.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", i, " is ", t, ", outside the vocabulary [0, ", file.vocab, ")"));
    }
    if (dtype == 2) {
      PutLe<uint16_t>(bytes, static_cast<uint16_t>(t));
    } else {
      PutLe<uint32_t>(bytes, static_cast<uint32_t>(t));
    }
  }
  return WriteFileAtomically(path, bytes);
}

absl::StatusOr<TokenFile> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> read = ReadWholeFile(path, base::FileUse::kJob);
  if (!read.ok() && read.status().code() == absl::StatusCode::kNotFound) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open token file (", read.status().message(),
                     "); create it with `rackrun data --input TEXT --output DIR`"));
  }
  if (!read.ok()) {
    // Not a regular file, or outside a confined worker's roots.
    return absl::Status(read.status().code(),
                        absl::StrCat("token file: ", read.status().message()));
  }
  return ParseTokenFile(*read, path);
}

absl::StatusOr<TokenFile> ParseTokenFile(std::string_view bytes, const std::string& path) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is not valid: ", why,
                                                   "; regenerate it with `rackrun data`"));
  };
  if (bytes.size() < kHeaderBytes) return bad("shorter than its 32-byte header");
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0) return bad("wrong magic");
  if (GetLe<uint32_t>(p + 8) != kVersion) {
    return bad(absl::StrCat("version ", GetLe<uint32_t>(p + 8), ", expected ", kVersion));
  }
  const uint32_t dtype = GetLe<uint32_t>(p + 12);
  if (dtype != 2 && dtype != 4) return bad(absl::StrCat("dtype ", dtype, ", expected 2 or 4"));
  const uint64_t count = GetLe<uint64_t>(p + 16);
  if (count > (bytes.size() - kHeaderBytes) / dtype ||
      bytes.size() != kHeaderBytes + count * dtype) {
    return bad(absl::StrCat("header says ", count, " tokens of ", dtype, " bytes but the file has ",
                            bytes.size() - kHeaderBytes, " payload bytes (truncated?)"));
  }
  TokenFile file;
  file.vocab = GetLe<uint32_t>(p + 24);
  file.end_of_document = static_cast<int32_t>(GetLe<uint32_t>(p + 28));
  if (file.vocab == 0) return bad("vocab 0");
  if (file.vocab > kMaxTokenVocab) {
    return bad(absl::StrCat("vocab ", file.vocab, " is above the limit of ", kMaxTokenVocab,
                            " (corrupt header?)"));
  }
  if (file.end_of_document < -1 ||
      (file.end_of_document >= 0 && static_cast<uint32_t>(file.end_of_document) >= file.vocab)) {
    return bad(absl::StrCat("end-of-document id ", file.end_of_document, " outside the vocab"));
  }
  file.tokens.resize(count);
  const unsigned char* q = p + kHeaderBytes;
  for (uint64_t i = 0; i < count; ++i) {
    const uint32_t t = dtype == 2 ? GetLe<uint16_t>(q + 2 * i) : GetLe<uint32_t>(q + 4 * i);
    if (t >= file.vocab) return bad(absl::StrCat("token ", i, " is ", t, " >= vocab ", file.vocab));
    file.tokens[i] = static_cast<int32_t>(t);
  }
  return file;
}

std::vector<int32_t> ByteTokenize(std::span<const std::string> documents) {
  std::vector<int32_t> tokens;
  size_t total = 0;
  for (const std::string& d : documents) total += d.size() + 1;
  tokens.reserve(total);
  for (const std::string& d : documents) {
    tokens.push_back(kByteEndOfDocument);
    for (const char c : d) tokens.push_back(static_cast<unsigned char>(c));
  }
  return tokens;
}

std::string ByteDetokenize(std::span<const int32_t> tokens) {
  std::string text;
  for (const int32_t t : tokens) {
    if (t == kByteEndOfDocument) {
      text += "\n<|eod|>\n";
    } else if (t >= 0 && t < 256) {
      text.push_back(static_cast<char>(t));
    }
  }
  return text;
}

std::vector<std::string> SplitDocuments(std::string_view text) {
  std::vector<std::string> docs;
  std::string current;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    const size_t next = end == std::string_view::npos ? text.size() : end + 1;
    const std::string_view line = text.substr(pos, next - pos);
    if (line == "\f\n" || line == "\f") {
      if (!current.empty()) docs.push_back(std::move(current));
      current.clear();
    } else {
      current.append(line);
    }
    pos = next;
  }
  if (!current.empty()) docs.push_back(std::move(current));
  return docs;
}

absl::StatusOr<DocumentSplit> SplitTrainValidation(std::vector<std::string> documents,
                                                   double fraction) {
  if (!(fraction >= 0 && fraction <= 0.5)) {
    return absl::InvalidArgumentError(
        absl::StrCat("validation fraction ", fraction, " must lie in [0, 0.5]"));
  }
  DocumentSplit split;
  if (fraction == 0 || documents.empty()) {
    split.train = std::move(documents);
    return split;
  }
  if (documents.size() == 1) {
    std::string& doc = documents[0];
    size_t cut = doc.size() - static_cast<size_t>(std::llround(fraction * doc.size()));
    // Prefer a line boundary within 1% of the text, so no word is split.
    const size_t newline = doc.rfind('\n', cut);
    if (newline != std::string::npos && cut - newline <= doc.size() / 100 + 1) cut = newline + 1;
    split.validation.push_back(doc.substr(cut));
    doc.resize(cut);
    split.train.push_back(std::move(doc));
    return split;
  }
  const size_t period = std::max<size_t>(2, static_cast<size_t>(std::llround(1.0 / fraction)));
  for (size_t i = 0; i < documents.size(); ++i) {
    if (i % period == period - 1) {
      split.validation.push_back(std::move(documents[i]));
    } else {
      split.train.push_back(std::move(documents[i]));
    }
  }
  if (split.validation.empty()) {
    split.validation.push_back(std::move(split.train.back()));
    split.train.pop_back();
  }
  return split;
}

double UnigramEntropy(std::span<const int32_t> tokens, int vocab) {
  if (tokens.empty()) return 0;
  std::vector<int64_t> counts(static_cast<size_t>(vocab), 0);
  for (const int32_t t : tokens) {
    if (t >= 0 && t < vocab) ++counts[static_cast<size_t>(t)];
  }
  const double n = static_cast<double>(tokens.size());
  double h = 0;
  for (const int64_t c : counts) {
    if (c > 0) {
      const double p = static_cast<double>(c) / n;
      h -= p * std::log(p);
    }
  }
  return h;
}

absl::StatusOr<WindowLoader> WindowLoader::Create(std::vector<int32_t> tokens,
                                                  int32_t end_of_document, int seq_len, int batch,
                                                  uint64_t seed, bool shuffle) {
  if (seq_len < 1 || batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("loader needs seq_len >= 1 and batch >= 1, got ", seq_len, " and ", batch));
  }
  if (tokens.size() < 2 * static_cast<size_t>(seq_len) + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token stream has ", tokens.size(), " tokens, fewer than 2 windows of model.seq_len + 1 = ",
        seq_len + 1, "; use more text or a shorter model.seq_len"));
  }
  WindowLoader loader(std::move(tokens), end_of_document, seq_len, batch, shuffle);
  // The loader's stream: SplitMix64-seeded xoshiro256** (its state is what checkpoints store).
  loader.position_.epoch_rng = base::Xoshiro256::FromSeed(seed ^ 0x6a09e667f3bcc909ULL).state();
  loader.StartEpoch();
  return loader;
}

WindowLoader::WindowLoader(std::vector<int32_t> tokens, int32_t end_of_document, int seq_len,
                           int batch, bool shuffle)
    : tokens_(std::move(tokens)),
      end_of_document_(end_of_document),
      seq_len_(seq_len),
      batch_(batch),
      shuffle_(shuffle) {}

void WindowLoader::StartEpoch() {
  base::Xoshiro256 rng(position_.epoch_rng);
  const int64_t n = static_cast<int64_t>(tokens_.size());
  shift_ = shuffle_ ? static_cast<int64_t>(rng.Below(static_cast<uint64_t>(seq_len_))) : 0;
  const int64_t windows = (n - 1 - shift_) / seq_len_;
  order_.resize(static_cast<size_t>(windows));
  for (int64_t w = 0; w < windows; ++w) order_[static_cast<size_t>(w)] = shift_ + w * seq_len_;
  if (shuffle_) {
    for (int64_t i = windows - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(i + 1)));
      std::swap(order_[static_cast<size_t>(i)], order_[static_cast<size_t>(j)]);
    }
  }
  next_epoch_rng_ = rng.state();
}

absl::Status WindowLoader::Restore(const LoaderPosition& position) {
  position_ = position;
  StartEpoch();
  if (position_.cursor > order_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("loader position cursor ", position_.cursor, " is past the ", order_.size(),
                     " windows of its epoch; the checkpoint belongs to other data"));
  }
  return absl::OkStatus();
}

void WindowLoader::Next(Batch& out) {
  out.batch = batch_;
  out.seq_len = seq_len_;
  const size_t rows = static_cast<size_t>(batch_) * static_cast<size_t>(seq_len_);
  out.inputs.resize(rows);
  out.targets.resize(rows);
  out.segment_starts.clear();
  for (int b = 0; b < batch_; ++b) {
    if (position_.cursor >= order_.size()) {
      position_.epoch += 1;
      position_.cursor = 0;
      position_.epoch_rng = next_epoch_rng_;
      StartEpoch();
    }
    const int64_t start = order_[position_.cursor++];
    const size_t row = static_cast<size_t>(b) * static_cast<size_t>(seq_len_);
    out.segment_starts.push_back(static_cast<int32_t>(row));
    for (int t = 0; t < seq_len_; ++t) {
      const int32_t input = tokens_[static_cast<size_t>(start + t)];
      out.inputs[row + static_cast<size_t>(t)] = input;
      out.targets[row + static_cast<size_t>(t)] = tokens_[static_cast<size_t>(start + t + 1)];
      if (t > 0 && end_of_document_ >= 0 && input == end_of_document_) {
        out.segment_starts.push_back(static_cast<int32_t>(row + static_cast<size_t>(t)));
      }
    }
  }
}

}  // namespace rackrun::runtime
