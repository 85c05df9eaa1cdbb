// Fuzz target: a token file's header and reader (data/token_file.h ParseTokenFile), then
// what training does first with a file that parses: the vocab-sized unigram counts and the
// loader's first batches over the file (data/loader.h, memory-mapped from a scratch copy).
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "data/indexed_dataset.h"
#include "data/loader.h"
#include "data/token_file.h"
#include "tests/fuzz/fuzz_target.h"

namespace data = ::rackrun::data;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes_in, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(bytes_in), size);
  absl::StatusOr<data::TokenFile> file = data::ParseTokenFile(bytes, "fuzz.tokens");
  absl::StatusOr<data::TokenFileHeader> header = data::ParseTokenFileHeader(bytes, "fuzz.tokens");
  FUZZ_CHECK(header.ok() || !file.ok());  // the whole-file checks include the header's
  if (!file.ok()) return 0;
  FUZZ_CHECK(file->vocab >= 1 && file->vocab <= data::kMaxTokenVocab);
  std::vector<int64_t> counts(file->vocab, 0);
  for (const int32_t t : file->tokens) {
    FUZZ_CHECK(t >= 0 && static_cast<uint32_t>(t) < file->vocab);
    ++counts[static_cast<size_t>(t)];
  }
  FUZZ_CHECK(data::UnigramEntropy(counts) >= 0);
  const std::string path = "/tmp/fuzz_token_file." + std::to_string(getpid()) + ".tokens";
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(size));
  absl::StatusOr<std::unique_ptr<data::Loader>> loader = data::Loader::Create(
      {{1, path}},
      {.seq_len = 4, .batch = 2, .seed = size, .shuffle = true, .vocab = 0, .field = "fuzz"});
  if (loader.ok()) {
    data::Batch batch;
    for (int i = 0; i < 3; ++i) {
      FUZZ_CHECK((*loader)->Next(batch).ok());  // ids were checked above
      FUZZ_CHECK(batch.inputs.size() == 8 && batch.targets.size() == 8);
    }
  }
  std::remove(path.c_str());
  return 0;
}
