// rackrun data: turns text into token files (byte-level tokenizer) and splits them into
// training and validation sets.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "flags/flags.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "tools/rackrun/command.h"

namespace rackrun::cli {
namespace {

namespace rt = ::rackrun::runtime;

constexpr const char* kDescription =
    R"(Tokenizes text into DIR/train.tokens and DIR/val.tokens (format: runtime/data.h,
docs/design.md section 8.4). Every input file is one or more documents: a line holding a single
form feed (\f) separates documents inside a file. A folder input means every regular
file in it, in name order.
)";

constexpr const char* kExample =
    R"(example:
  tools/fetch-corpus && rackrun data --input data/brown/brown.txt --output data/brown
)";

}  // namespace

int DataCommand(const Args& args) {
  std::vector<std::string> inputs;
  std::string output;
  double val_fraction = 0.05;
  flags::FlagSet flag_set("rackrun data", "--input PATH [--input PATH]... --output DIR [options]");
  flag_set.Describe(kDescription);
  flag_set.Epilogue(kExample);
  flag_set.Strings("--input", &inputs, "PATH", "text file or folder (repeatable)");
  flag_set.String("--output", &output, "DIR", "output folder (created if missing)");
  flag_set.Double("--val-fraction", &val_fraction, "F",
                  "share of documents for validation, in (0, 0.5]: every round(1/F)-th "
                  "document; with a single document, its last F of bytes");
  flag_set
      .Custom("--tokenizer", "NAME",
              "bytes (the only one: UTF-8 bytes 0..255 plus an end-of-document mark 256, "
              "vocab 257)",
              [](std::string_view value) {
                if (value != "bytes") {
                  return absl::InvalidArgumentError("only 'bytes' is available");
                }
                return absl::OkStatus();
              })
      .Default("bytes");
  if (std::optional<int> exit = flag_set.ParseCommandLine(args)) return *exit;
  if (inputs.empty()) return flag_set.Fail("--input", "missing; give a text file or folder");
  if (output.empty()) return flag_set.Fail("--output", "missing; give the output folder");
  if (val_fraction == 0) {
    // An empty val.tokens used to be written; training then failed on it with a message
    // about seq_len.
    return flag_set.Fail("--val-fraction",
                         "0 would write an empty validation file, which training cannot use as "
                         "data.validation; give a fraction in (0, 0.5] (default 0.05), and leave "
                         "data.validation out of the job spec to train without validation");
  }

  std::vector<std::string> files;
  for (const std::string& input : inputs) {
    std::error_code ec;
    if (std::filesystem::is_directory(input, ec)) {
      std::vector<std::string> in_dir;
      for (const auto& e : std::filesystem::directory_iterator(input, ec)) {
        if (e.is_regular_file()) in_dir.push_back(e.path().string());
      }
      std::sort(in_dir.begin(), in_dir.end());
      files.insert(files.end(), in_dir.begin(), in_dir.end());
    } else {
      files.push_back(input);
    }
  }
  std::vector<std::string> documents;
  int64_t bytes = 0;
  for (const std::string& file : files) {
    absl::StatusOr<std::string> text = rt::ReadWholeFile(file);
    if (!text.ok()) {
      std::fprintf(stderr, "rackrun data: --input: cannot read '%s'; check the path\n",
                   file.c_str());
      return 1;
    }
    bytes += static_cast<int64_t>(text->size());
    for (std::string& d : rt::SplitDocuments(*text)) documents.push_back(std::move(d));
  }
  if (documents.empty()) {
    std::fprintf(stderr, "rackrun data: the inputs hold no text\n");
    return 1;
  }
  const size_t document_count = documents.size();
  absl::StatusOr<rt::DocumentSplit> split =
      rt::SplitTrainValidation(std::move(documents), val_fraction);
  if (!split.ok()) return flag_set.Fail("--val-fraction", std::string(split.status().message()));
  if (split->validation.empty() || split->train.empty()) {
    std::fprintf(stderr,
                 "rackrun data: --val-fraction %g leaves the %s set empty; use a larger "
                 "fraction or more input text\n",
                 val_fraction, split->train.empty() ? "training" : "validation");
    return 1;
  }

  std::error_code ec;
  std::filesystem::create_directories(output, ec);
  if (ec) {
    std::fprintf(stderr, "rackrun data: cannot create '%s': %s\n", output.c_str(),
                 ec.message().c_str());
    return 1;
  }
  struct Part {
    const char* name;
    const std::vector<std::string>* docs;
  };
  for (const Part& part : {Part{"train", &split->train}, Part{"val", &split->validation}}) {
    rt::TokenFile file{.vocab = rt::kByteVocab,
                       .end_of_document = rt::kByteEndOfDocument,
                       .tokens = rt::ByteTokenize(*part.docs)};
    const std::string path = (std::filesystem::path(output) / part.name).string() + ".tokens";
    if (absl::Status s = rt::WriteTokenFile(path, file); !s.ok()) {
      std::fprintf(stderr, "rackrun data: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    std::printf("%-6s %6zu documents %10zu tokens  unigram entropy %.4f nats/token  -> %s\n",
                part.name, part.docs->size(), file.tokens.size(),
                rt::UnigramEntropy(file.tokens, rt::kByteVocab), path.c_str());
  }
  std::printf("read %zu file(s), %lld bytes, %zu documents; tokenizer bytes (vocab %d)\n",
              files.size(), static_cast<long long>(bytes), document_count, rt::kByteVocab);
  return 0;
}

}  // namespace rackrun::cli
