// Fuzz target: a token file's header and reader (runtime/data.h ParseTokenFile), then
// what training does first with a file that parses: the vocab-sized unigram counts and a
// window loader's first batches.
#include <string>
#include <string_view>

#include "runtime/data.h"
#include "tests/fuzz/fuzz_target.h"

namespace rt = ::rackrun::runtime;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<rt::TokenFile> file = rt::ParseTokenFile(bytes, "fuzz.tokens");
  if (!file.ok()) return 0;
  FUZZ_CHECK(file->vocab >= 1 && file->vocab <= rt::kMaxTokenVocab);
  for (const int32_t t : file->tokens) {
    FUZZ_CHECK(t >= 0 && static_cast<uint32_t>(t) < file->vocab);
  }
  const double entropy = rt::UnigramEntropy(file->tokens, static_cast<int>(file->vocab));
  FUZZ_CHECK(entropy >= 0);
  absl::StatusOr<rt::WindowLoader> loader =
      rt::WindowLoader::Create(file->tokens, file->end_of_document, /*seq_len=*/4, /*batch=*/2,
                               /*seed=*/size, /*shuffle=*/true);
  if (!loader.ok()) return 0;
  rt::Batch batch;
  for (int i = 0; i < 3; ++i) {
    loader->Next(batch);
    FUZZ_CHECK(batch.inputs.size() == 8 && batch.targets.size() == 8);
  }
  return 0;
}
