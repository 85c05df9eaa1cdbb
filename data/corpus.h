// Documents from the inputs `rackrun data` reads, one at a time (never a whole input in
// memory unless one document is that large):
//  - a text file: one or more documents, separated by lines holding a single form feed
//    ("\f"), as the Brown corpus is laid out by tools/fetch-corpus;
//  - a JSON Lines file (name ending in .jsonl, .ndjson or .json): one JSON object per
//    line, the document in its string field `json_key` (default "text", Megatron's
//    --json-keys); blank lines are skipped;
//  - a folder: its regular files in name order (not its subfolders), each by its own kind.
// Empty documents are dropped.
//
// Bad input stops the reader with an InvalidArgument naming the file and line: malformed
// JSON (with the parser's reason), a line that is not an object, a missing or non-string
// key (with the keys the object has), and bytes that are not UTF-8, which follow the
// policy: error (default: name the file, line and byte), replace (each bad byte becomes
// U+FFFD) or skip (the document is dropped and counted).
#ifndef RACKRUN_DATA_CORPUS_H_
#define RACKRUN_DATA_CORPUS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "data/mapped_file.h"

namespace rackrun::data {

enum class InvalidUtf8 { kError, kReplace, kSkip };
// "error" | "replace" | "skip".
absl::StatusOr<InvalidUtf8> ParseInvalidUtf8(absl::string_view name);

struct Document {
  std::string text;
  std::string file;  // where it came from, for messages
  int64_t line = 0;  // its first line (1-based)
};

struct CorpusOptions {
  std::string json_key = "text";
  InvalidUtf8 invalid_utf8 = InvalidUtf8::kError;
};

// The files an input stands for, in reading order (a folder's regular files by name).
absl::StatusOr<std::vector<std::string>> CorpusFiles(const std::string& input);

class DocumentReader {
 public:
  static absl::StatusOr<DocumentReader> Open(const std::string& input, CorpusOptions options);

  // The next document into `doc`: true, or false at the end of the input.
  absl::StatusOr<bool> Next(Document& doc);

  int64_t total_bytes() const { return total_bytes_; }  // of every file of the input
  int64_t bytes_read() const { return done_bytes_ + static_cast<int64_t>(pos_); }
  int64_t skipped_documents() const { return skipped_; }

 private:
  DocumentReader() = default;
  absl::Status OpenFile();
  // A line of the current file, without its "\n"; false at its end.
  bool NextLine(std::string_view& line);
  absl::StatusOr<bool> NextText(Document& doc);
  absl::StatusOr<bool> NextJson(Document& doc);
  // Applies the UTF-8 policy to `text` (from `line`); false: skip the document.
  absl::StatusOr<bool> CheckUtf8(std::string& text, int64_t line);

  CorpusOptions options_;
  std::vector<std::string> files_;
  size_t next_file_ = 0;
  std::unique_ptr<MappedFile> file_;
  bool json_ = false;
  size_t pos_ = 0;
  int64_t line_ = 0;
  int64_t total_bytes_ = 0;
  int64_t done_bytes_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace rackrun::data

#endif  // RACKRUN_DATA_CORPUS_H_
