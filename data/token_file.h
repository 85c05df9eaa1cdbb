// rackrun's own token files (`.tokens`, written by `rackrun data` before it wrote
// Megatron-LM datasets): still read by the loader (token_source.h), and written by tests.
//
// Format (docs/design.md section 8.4), all integers little-endian:
//   offset  0  char[8]  magic "RKRTOKNS"
//   offset  8  uint32   version (1)
//   offset 12  uint32   dtype: bytes per token id, 2 (uint16) or 4 (uint32)
//   offset 16  uint64   count: number of token ids that follow
//   offset 24  uint32   vocab: ids are < vocab
//   offset 28  int32    end-of-document id, or -1 when the file has no document marks
//   offset 32  count token ids of `dtype` bytes each
// A reader refuses a file whose size is not exactly 32 + count * dtype, and a vocab
// above kMaxTokenVocab: every size in the header is bounded before it is used.
//
// Byte-level files put the end-of-document mark 256 BEFORE every document (ByteTokenize),
// so the mark also opens a sequence.
#ifndef RACKRUN_DATA_TOKEN_FILE_H_
#define RACKRUN_DATA_TOKEN_FILE_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rackrun::data {

// Largest vocabulary a dataset may declare: 2^24, 64x the largest tokenizers in use
// (~256k ids). A header above it is refused before anything is sized by it (the model's
// embedding and the unigram counts are vocab-sized).
inline constexpr uint32_t kMaxTokenVocab = uint32_t{1} << 24;
inline constexpr size_t kTokenFileHeaderBytes = 32;

struct TokenFile {
  uint32_t vocab = 0;
  int32_t end_of_document = -1;  // -1: no document marks
  std::vector<int32_t> tokens;
};

// A token file's header, checked against the file's size.
struct TokenFileHeader {
  uint32_t dtype = 0;  // bytes per id
  uint64_t count = 0;
  uint32_t vocab = 0;
  int32_t end_of_document = -1;
};

// Writes `file` to `path` (dtype uint16 when vocab <= 65536, else uint32), atomically:
// temp file, fsync, rename. Fails if a token is outside [0, vocab).
absl::Status WriteTokenFile(const std::string& path, const TokenFile& file);
// Reads a whole token file; a wrong magic, version, dtype, size, vocab (0 or above
// kMaxTokenVocab) or out-of-range id is an InvalidArgument naming the file.
absl::StatusOr<TokenFile> ReadTokenFile(const std::string& path);
// The same checks on a file's bytes already in memory; `path` only names it in errors.
absl::StatusOr<TokenFile> ParseTokenFile(std::string_view bytes, const std::string& path);
// The header checks alone (the ids are not looked at): what a memory-mapped reader needs.
absl::StatusOr<TokenFileHeader> ParseTokenFileHeader(std::string_view bytes,
                                                     const std::string& path);
// Whether `bytes` start with the token-file magic.
bool LooksLikeTokenFile(std::string_view bytes);

// Byte-level token-file layout of documents: [EOD, bytes of doc 0, EOD, bytes of doc 1, ...].
std::vector<int32_t> ByteTokenize(std::span<const std::string> documents);

}  // namespace rackrun::data

#endif  // RACKRUN_DATA_TOKEN_FILE_H_
