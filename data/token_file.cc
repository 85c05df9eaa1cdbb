#include "data/token_file.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "data/tokenizer.h"

namespace rackrun::data {
namespace {

constexpr char kMagic[8] = {'R', 'K', 'R', 'T', 'O', 'K', 'N', 'S'};
constexpr uint32_t kVersion = 1;

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
  bytes.reserve(kTokenFileHeaderBytes + file.tokens.size() * dtype);
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
  return base::WriteFileAtomically(path, bytes);
}

absl::StatusOr<TokenFile> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> read = base::ReadWholeFile(path, base::FileUse::kJob);
  if (!read.ok() && read.status().code() == absl::StatusCode::kNotFound) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open token file (", read.status().message(),
                     "); create data with `rackrun data --input TEXT --output DIR`"));
  }
  if (!read.ok()) {
    // Not a regular file, or outside a confined worker's roots.
    return absl::Status(read.status().code(),
                        absl::StrCat("token file: ", read.status().message()));
  }
  return ParseTokenFile(*read, path);
}

bool LooksLikeTokenFile(std::string_view bytes) {
  return bytes.size() >= sizeof(kMagic) && std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0;
}

absl::StatusOr<TokenFileHeader> ParseTokenFileHeader(std::string_view bytes,
                                                     const std::string& path) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is not valid: ", why,
                                                   "; regenerate it with `rackrun data`"));
  };
  if (bytes.size() < kTokenFileHeaderBytes) return bad("shorter than its 32-byte header");
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  if (!LooksLikeTokenFile(bytes)) return bad("wrong magic");
  if (GetLe<uint32_t>(p + 8) != kVersion) {
    return bad(absl::StrCat("version ", GetLe<uint32_t>(p + 8), ", expected ", kVersion));
  }
  TokenFileHeader h;
  h.dtype = GetLe<uint32_t>(p + 12);
  if (h.dtype != 2 && h.dtype != 4)
    return bad(absl::StrCat("dtype ", h.dtype, ", expected 2 or 4"));
  h.count = GetLe<uint64_t>(p + 16);
  if (h.count > (bytes.size() - kTokenFileHeaderBytes) / h.dtype ||
      bytes.size() != kTokenFileHeaderBytes + h.count * h.dtype) {
    return bad(absl::StrCat("header says ", h.count, " tokens of ", h.dtype,
                            " bytes but the file has ", bytes.size() - kTokenFileHeaderBytes,
                            " payload bytes (truncated?)"));
  }
  h.vocab = GetLe<uint32_t>(p + 24);
  h.end_of_document = static_cast<int32_t>(GetLe<uint32_t>(p + 28));
  if (h.vocab == 0) return bad("vocab 0");
  if (h.vocab > kMaxTokenVocab) {
    return bad(absl::StrCat("vocab ", h.vocab, " is above the limit of ", kMaxTokenVocab,
                            " (corrupt header?)"));
  }
  if (h.end_of_document < -1 ||
      (h.end_of_document >= 0 && static_cast<uint32_t>(h.end_of_document) >= h.vocab)) {
    return bad(absl::StrCat("end-of-document id ", h.end_of_document, " outside the vocab"));
  }
  return h;
}

absl::StatusOr<TokenFile> ParseTokenFile(std::string_view bytes, const std::string& path) {
  absl::StatusOr<TokenFileHeader> h = ParseTokenFileHeader(bytes, path);
  if (!h.ok()) return h.status();
  TokenFile file;
  file.vocab = h->vocab;
  file.end_of_document = h->end_of_document;
  file.tokens.resize(h->count);
  const auto* q = reinterpret_cast<const unsigned char*>(bytes.data()) + kTokenFileHeaderBytes;
  for (uint64_t i = 0; i < h->count; ++i) {
    const uint32_t t = h->dtype == 2 ? GetLe<uint16_t>(q + 2 * i) : GetLe<uint32_t>(q + 4 * i);
    if (t >= file.vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is not valid: token ",
                                                     i, " is ", t, " >= vocab ", file.vocab,
                                                     "; regenerate it with `rackrun data`"));
    }
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

}  // namespace rackrun::data
