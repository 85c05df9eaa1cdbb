// Replays files through a fuzz target's LLVMFuzzerTestOneInput (tests/fuzz/fuzz_target.h):
//   fuzz_<target>_replay PATH...   each PATH a file or a folder (every regular file in it,
//                                  recursively, in name order)
// Prints each file before running it, so the one that crashes is named. Exit 0 when all
// ran; 2 when a path does not exist or no file was found (a missing corpus is an error).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "base/file.h"
#include "tests/fuzz/fuzz_target.h"

int main(int argc, char** argv) {
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path path(argv[i]);
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
      for (const auto& e : std::filesystem::recursive_directory_iterator(path)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
    } else if (std::filesystem::is_regular_file(path, ec)) {
      files.push_back(path);
    } else {
      std::fprintf(stderr, "replay: '%s' is not a file or folder\n", argv[i]);
      return 2;
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    std::fprintf(stderr, "replay: no input files\n");
    return 2;
  }
  for (const std::filesystem::path& file : files) {
    absl::StatusOr<std::string> read = rackrun::base::ReadWholeFile(file.string());
    if (!read.ok()) {
      std::fprintf(stderr, "replay: %s\n", std::string(read.status().message()).c_str());
      return 2;
    }
    const std::string& bytes = *read;
    std::fprintf(stderr, "replay: %s (%zu bytes)\n", file.c_str(), bytes.size());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::printf("replay: %zu inputs ran\n", files.size());
  return 0;
}
