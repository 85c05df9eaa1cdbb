#include "data/corpus.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/utf8.h"
#include "nlohmann/json.hpp"

namespace rackrun::data {
namespace {

bool IsJsonLines(const std::string& path) {
  return absl::EndsWith(path, ".jsonl") || absl::EndsWith(path, ".ndjson") ||
         absl::EndsWith(path, ".json");
}

}  // namespace

absl::StatusOr<InvalidUtf8> ParseInvalidUtf8(absl::string_view name) {
  if (name == "error") return InvalidUtf8::kError;
  if (name == "replace") return InvalidUtf8::kReplace;
  if (name == "skip") return InvalidUtf8::kSkip;
  return absl::InvalidArgumentError(
      absl::StrCat("'", name, "' is not a policy; use error, replace or skip"));
}

absl::StatusOr<std::vector<std::string>> CorpusFiles(const std::string& input) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(input, ec);
  if (ec || !fs::exists(st)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--input: '", input, "' does not exist; check the path"));
  }
  if (!fs::is_directory(st)) return std::vector<std::string>{input};
  std::vector<std::string> files;
  for (const fs::directory_entry& e : fs::directory_iterator(input, ec)) {
    if (e.is_regular_file()) files.push_back(e.path().string());
  }
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--input: cannot list folder '", input, "': ", ec.message()));
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--input: folder '", input, "' holds no regular files"));
  }
  return files;
}

absl::StatusOr<DocumentReader> DocumentReader::Open(const std::string& input,
                                                    CorpusOptions options) {
  absl::StatusOr<std::vector<std::string>> files = CorpusFiles(input);
  if (!files.ok()) return files.status();
  DocumentReader r;
  r.options_ = std::move(options);
  r.files_ = *std::move(files);
  for (const std::string& f : r.files_) {
    std::error_code ec;
    r.total_bytes_ += static_cast<int64_t>(std::filesystem::file_size(f, ec));
  }
  if (absl::Status s = r.OpenFile(); !s.ok()) return s;
  return r;
}

absl::Status DocumentReader::OpenFile() {
  if (file_ != nullptr) done_bytes_ += static_cast<int64_t>(file_->size());
  file_.reset();
  pos_ = 0;
  line_ = 0;
  if (next_file_ >= files_.size()) return absl::OkStatus();
  const std::string& path = files_[next_file_++];
  absl::StatusOr<MappedFile> f = MappedFile::Open(path, "input", MappedFile::Access::kSequential);
  if (!f.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--input: ", f.status().message()));
  }
  file_ = std::make_unique<MappedFile>(*std::move(f));
  json_ = IsJsonLines(path);
  return absl::OkStatus();
}

bool DocumentReader::NextLine(std::string_view& line) {
  const std::string_view bytes = file_->bytes();
  if (pos_ >= bytes.size()) return false;
  size_t end = bytes.find('\n', pos_);
  if (end == std::string_view::npos) end = bytes.size();
  line = bytes.substr(pos_, end - pos_);
  pos_ = std::min(bytes.size(), end + 1);
  ++line_;
  return true;
}

absl::StatusOr<bool> DocumentReader::CheckUtf8(std::string& text, int64_t line) {
  const size_t bad = base::FirstInvalidUtf8(text);
  if (bad == std::string_view::npos) return true;
  switch (options_.invalid_utf8) {
    case InvalidUtf8::kReplace:
      text = base::ReplaceInvalidUtf8(text);
      return true;
    case InvalidUtf8::kSkip:
      ++skipped_;
      return false;
    case InvalidUtf8::kError:
      break;
  }
  // The line and column of the bad byte (a text document spans lines).
  const std::string_view before = std::string_view(text).substr(0, bad);
  const int64_t at_line =
      line + static_cast<int64_t>(std::count(before.begin(), before.end(), '\n'));
  const size_t line_start = before.rfind('\n');
  const size_t column = line_start == std::string_view::npos ? bad : bad - line_start - 1;
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s:%d: invalid UTF-8 (byte 0x%02x at byte %d of the line); fix the input, or pass "
      "--invalid-utf8 replace (U+FFFD) or skip (drop the document)",
      file_->path(), at_line, static_cast<unsigned char>(text[bad]), column + 1));
}

absl::StatusOr<bool> DocumentReader::Next(Document& doc) {
  while (file_ != nullptr) {
    absl::StatusOr<bool> got = json_ ? NextJson(doc) : NextText(doc);
    if (!got.ok() || *got) return got;
    if (absl::Status s = OpenFile(); !s.ok()) return s;
  }
  return false;
}

absl::StatusOr<bool> DocumentReader::NextText(Document& doc) {
  std::string_view line;
  while (true) {
    doc.text.clear();
    doc.file = file_->path();
    doc.line = 0;
    bool more = false;
    while ((more = NextLine(line))) {
      if (line == "\f" || line == "\f\r") break;
      if (doc.line == 0) doc.line = line_;
      doc.text.append(line);
      if (pos_ <= file_->size() && file_->bytes()[pos_ - 1] == '\n') doc.text.push_back('\n');
    }
    if (doc.text.empty()) {
      if (!more) return false;
      continue;  // an empty document between two marks
    }
    absl::StatusOr<bool> keep = CheckUtf8(doc.text, doc.line);
    if (!keep.ok()) return keep.status();
    if (*keep) return true;
  }
}

absl::StatusOr<bool> DocumentReader::NextJson(Document& doc) {
  std::string_view line;
  while (NextLine(line)) {
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    doc.file = file_->path();
    doc.line = line_;
    std::string raw(line);
    absl::StatusOr<bool> keep = CheckUtf8(raw, line_);
    if (!keep.ok()) return keep.status();
    if (!*keep) continue;
    const std::string where = absl::StrCat(file_->path(), ":", line_, ": ");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(raw);
    } catch (const nlohmann::json::parse_error& e) {
      return absl::InvalidArgumentError(absl::StrCat(where, "malformed JSON (", e.what(),
                                                     "); each line must be one JSON object"));
    }
    if (!j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, "a JSON ", j.type_name(),
                                                     ", not an object; each line must be one "
                                                     "JSON object"));
    }
    const auto it = j.find(options_.json_key);
    if (it == j.end()) {
      std::vector<std::string> keys;
      for (const auto& item : j.items()) keys.push_back(item.key());
      return absl::InvalidArgumentError(absl::StrCat(
          where, "no key \"", options_.json_key, "\" (the object has ",
          keys.empty() ? "no keys" : absl::StrCat("\"", absl::StrJoin(keys, "\", \""), "\""),
          "); choose the key with --json-key"));
    }
    if (!it->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, "\"", options_.json_key, "\" is a ",
                                                     it->type_name(), ", not a string"));
    }
    doc.text = it->get<std::string>();
    if (!doc.text.empty()) return true;
  }
  return false;
}

}  // namespace rackrun::data
