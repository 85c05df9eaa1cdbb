// rackrun data: text (files, folders, JSON Lines) -> one Megatron-LM dataset per input, and
// `rackrun data tokenizer --train`: a SentencePiece model from a corpus.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "data/corpus.h"
#include "data/prepare.h"
#include "data/tokenizer.h"
#include "flags/flags.h"
#include "tools/rackrun/command.h"

namespace rackrun::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kDescription =
    R"(Tokenizes each input into a Megatron-LM indexed dataset in DIR: DIR/NAME.bin + DIR/NAME.idx
(the format Megatron's preprocess_data.py writes; NAME is the input's file or folder name
without its extension) and DIR/NAME.meta.json (the tokenizer, counts, unigram entropy); with
--val-fraction F > 0 also DIR/NAME-val (every round(1/F)-th document). Every document ends
with the tokenizer's end-of-document (EOS) id.

Inputs: a text file (documents separated by lines holding a single form feed, \f), a JSON
Lines file (.jsonl, .ndjson, .json: one object per line, the text under --json-key), or a
folder (its regular files in name order). A bad line stops the run naming the file and line,
and leaves no dataset under the output names. Tokenizes on every core; memory stays bounded
whatever the input's size.

Train a SentencePiece tokenizer first with `rackrun data tokenizer --train` (see its --help).
)";

constexpr const char* kExample =
    R"(examples:
  tools/fetch-corpus && rackrun data --input out/corpus/brown/brown.txt --output out/corpus/brown
  rackrun data tokenizer --train --input out/corpus/brown/brown.txt --vocab 4096 \
      --output out/corpus/brown/bpe4096.model
  rackrun data --input docs.jsonl --json-key content --tokenizer out/corpus/brown/bpe4096.model \
      --output out/data --val-fraction 0.01
)";

// A one-line progress bar on stderr, redrawn in place.
void ShowProgress(const data::PrepareProgress& p, const std::string& name) {
  const double fraction =
      p.total_bytes > 0 ? static_cast<double>(p.bytes_read) / static_cast<double>(p.total_bytes)
                        : 1;
  constexpr int kWidth = 30;
  const int filled = std::clamp(static_cast<int>(fraction * kWidth), 0, kWidth);
  std::fprintf(stderr, "\r%s [%s%s] %3.0f%%  %.1f MB/s  %lld documents  %lld tokens   ",
               name.c_str(), std::string(static_cast<size_t>(filled), '#').c_str(),
               std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), 100 * fraction,
               p.seconds > 0 ? static_cast<double>(p.bytes_read) / 1e6 / p.seconds : 0.0,
               static_cast<long long>(p.documents), static_cast<long long>(p.tokens));
  std::fflush(stderr);
}

std::string DatasetName(const std::string& input) {
  const fs::path p = fs::path(input).lexically_normal();
  const fs::path base = p.has_filename() ? p : p.parent_path();
  return fs::is_directory(input) ? base.filename().string() : base.stem().string();
}

void PrintDataset(const char* part, const data::PreparedDataset& d) {
  std::printf("%-5s %8lld documents %12lld tokens  unigram entropy %.4f nats/token  -> %s\n", part,
              static_cast<long long>(d.info.documents), static_cast<long long>(d.info.tokens),
              d.info.unigram_entropy, d.prefix.c_str());
}

int TrainTokenizer(const Args& args) {
  std::vector<std::string> inputs;
  std::string output, model_type = "bpe", json_key = "text";
  int vocab = 4096, threads = 0;
  int64_t max_sentences = 2000000;
  double coverage = 1.0;
  bool train = false;
  flags::FlagSet flag_set("rackrun data tokenizer",
                          "--train --input PATH [--input PATH]... --output MODEL [options]");
  flag_set.Describe(
      "Trains a SentencePiece model (Debian's libsentencepiece, the library's own trainer) on\n"
      "the lines of the inputs' documents (text files, folders, JSON Lines as `rackrun data`\n"
      "reads them) and writes it to MODEL (a .model file spm_encode and `rackrun data\n"
      "--tokenizer MODEL` read). The pieces hold unk 0, bos 1, eos 2 (the end-of-document id).\n");
  flag_set.Switch("--train", &train, "train a model (the only action)");
  flag_set.Strings("--input", &inputs, "PATH", "text file, folder or JSON Lines file (repeatable)");
  flag_set.String("--output", &output, "MODEL", "the .model file to write (atomically)");
  flag_set.Int("--vocab", &vocab, "N", "vocabulary size").Range(8, 1 << 20);
  flag_set.String("--model-type", &model_type, "TYPE", "bpe or unigram");
  flag_set.String("--json-key", &json_key, "KEY", "the text's key in JSON Lines inputs");
  flag_set.Int("--max-sentences", &max_sentences, "N", "sentences sampled for training (0 = all)")
      .Range(0);
  flag_set
      .Double("--character-coverage", &coverage, "F",
              "share of characters the pieces must cover (0.9995 for large alphabets)")
      .Range(0.5, 1);
  flag_set.Int("--threads", &threads, "N", "trainer threads (0 = every core)").Range(0, 1024);
  if (std::optional<int> exit = flag_set.ParseCommandLine(args)) return *exit;
  if (!train) return flag_set.Fail("--train", "missing; `rackrun data tokenizer --train ...`");
  if (inputs.empty()) return flag_set.Fail("--input", "missing; give a text file or folder");
  if (output.empty()) return flag_set.Fail("--output", "missing; give the .model file to write");

  // Sentences: the non-empty lines of every document of every input, in order.
  size_t next_input = 0;
  std::optional<data::DocumentReader> reader;
  data::Document doc;
  std::vector<std::string> lines;
  size_t next_line = 0;
  absl::Status failure;
  const auto next = [&](std::string* out) -> bool {
    while (next_line >= lines.size()) {
      if (!reader.has_value()) {
        if (next_input >= inputs.size()) return false;
        absl::StatusOr<data::DocumentReader> r =
            data::DocumentReader::Open(inputs[next_input++], {.json_key = json_key});
        if (!r.ok()) {
          failure = r.status();
          return false;
        }
        reader.emplace(*std::move(r));
      }
      absl::StatusOr<bool> got = reader->Next(doc);
      if (!got.ok()) {
        failure = got.status();
        return false;
      }
      if (!*got) {
        reader.reset();
        continue;
      }
      lines.clear();
      next_line = 0;
      for (absl::string_view l : absl::StrSplit(doc.text, '\n', absl::SkipWhitespace())) {
        lines.emplace_back(l);
      }
    }
    *out = std::move(lines[next_line++]);
    return true;
  };
  const absl::Status s = data::TrainSentencePiece({.output = output,
                                                   .vocab_size = vocab,
                                                   .model_type = model_type,
                                                   .character_coverage = coverage,
                                                   .max_sentences = max_sentences,
                                                   .threads = threads},
                                                  next);
  if (!failure.ok()) return flag_set.Fail(failure, 1);
  if (!s.ok()) return flag_set.Fail(s, 1);
  absl::StatusOr<std::unique_ptr<data::Tokenizer>> made = data::OpenTokenizer(output);
  if (!made.ok()) return flag_set.Fail(made.status(), 1);
  std::printf("wrote %s: %s\n", output.c_str(), (*made)->info().Describe().c_str());
  return 0;
}

}  // namespace

int DataCommand(const Args& args) {
  if (!args.empty() && args[0] == "tokenizer")
    return TrainTokenizer(Args(args.begin() + 1, args.end()));
  std::vector<std::string> inputs;
  std::string output, tokenizer_name = "bytes", json_key = "text", invalid_utf8 = "error";
  std::string progress = "auto";
  double val_fraction = 0.05;
  int threads = 0;
  flags::FlagSet flag_set("rackrun data",
                          "--input PATH [--input PATH]... --output DIR [options]\n"
                          "       rackrun data tokenizer --train --input PATH... --output MODEL");
  flag_set.Describe(kDescription);
  flag_set.Epilogue(kExample);
  flag_set.Strings("--input", &inputs, "PATH", "text file, folder or JSON Lines file (repeatable)");
  flag_set.String("--output", &output, "DIR", "output folder (created if missing)");
  flag_set.String("--tokenizer", &tokenizer_name, "NAME",
                  "bytes (UTF-8 bytes 0..255, end-of-document 256, vocab 257) or a SentencePiece "
                  ".model file (BPE or unigram)");
  flag_set.String("--json-key", &json_key, "KEY", "the text's key in JSON Lines inputs");
  flag_set
      .Double("--val-fraction", &val_fraction, "F",
              "share of documents for the validation dataset NAME-val, in [0, 0.5] (0: none): "
              "every round(1/F)-th document; with a single document, its last F of bytes")
      .Range(0, 0.5);
  flag_set.String("--invalid-utf8", &invalid_utf8, "POLICY",
                  "bytes that are not UTF-8: error (name the file and line), replace (U+FFFD) "
                  "or skip (drop the document)");
  flag_set.Int("--threads", &threads, "N", "tokenizing threads (0 = every core)").Range(0, 1024);
  flag_set.String("--progress", &progress, "WHEN",
                  "auto (when stderr is a terminal), always or never");
  if (std::optional<int> exit = flag_set.ParseCommandLine(args)) return *exit;
  if (inputs.empty()) return flag_set.Fail("--input", "missing; give a text file or folder");
  if (output.empty()) return flag_set.Fail("--output", "missing; give the output folder");
  absl::StatusOr<data::InvalidUtf8> policy = data::ParseInvalidUtf8(invalid_utf8);
  if (!policy.ok()) return flag_set.Fail("--invalid-utf8", std::string(policy.status().message()));
  if (progress != "auto" && progress != "always" && progress != "never") {
    return flag_set.Fail("--progress", "use auto, always or never");
  }
  const bool show = progress == "always" || (progress == "auto" && ::isatty(STDERR_FILENO));

  std::map<std::string, std::string> names;  // NAME -> input
  for (const std::string& input : inputs) {
    const std::string name = DatasetName(input);
    if (name.empty())
      return flag_set.Fail("--input", "'" + input + "' has no name to give its dataset");
    if (auto [it, fresh] = names.emplace(name, input); !fresh) {
      return flag_set.Fail(
          "--input", "'" + it->second + "' and '" + input + "' would both write the dataset " +
                         name + "; rename one or run them into different --output folders");
    }
  }
  absl::StatusOr<std::unique_ptr<data::Tokenizer>> tokenizer = data::OpenTokenizer(tokenizer_name);
  if (!tokenizer.ok())
    return flag_set.Fail("--tokenizer", std::string(tokenizer.status().message()));
  std::error_code ec;
  fs::create_directories(output, ec);
  if (ec) {
    std::fprintf(stderr, "rackrun data: --output: cannot create '%s': %s\n", output.c_str(),
                 ec.message().c_str());
    return 1;
  }
  int64_t bytes = 0;
  double seconds = 0;
  int used_threads = 0;
  for (const std::string& input : inputs) {
    const std::string name = DatasetName(input);
    const std::string prefix = (fs::path(output) / name).string();
    data::PrepareOptions options{.tokenizer = tokenizer->get(),
                                 .corpus = {.json_key = json_key, .invalid_utf8 = *policy},
                                 .val_fraction = val_fraction,
                                 .threads = threads,
                                 .on_progress = {}};
    if (show) options.on_progress = [&](const data::PrepareProgress& p) { ShowProgress(p, name); };
    absl::StatusOr<data::PrepareResult> r =
        data::PrepareDataset(input, prefix, prefix + "-val", options);
    if (show) std::fprintf(stderr, "\n");
    if (!r.ok()) {
      std::fprintf(stderr, "rackrun data: %s\n", std::string(r.status().message()).c_str());
      return 1;
    }
    PrintDataset("train", r->train);
    if (r->validation) PrintDataset("val", *r->validation);
    if (r->skipped_documents > 0) {
      std::printf("      %lld documents skipped (--invalid-utf8 skip)\n",
                  static_cast<long long>(r->skipped_documents));
    }
    bytes += r->bytes;
    seconds += r->seconds;
    used_threads = r->threads;
  }
  std::printf("read %zu input(s), %lld bytes in %.2f s (%.1f MB/s on %d threads); tokenizer %s\n",
              inputs.size(), static_cast<long long>(bytes), seconds,
              seconds > 0 ? static_cast<double>(bytes) / 1e6 / seconds : 0.0, used_threads,
              (*tokenizer)->info().Describe().c_str());
  return 0;
}

}  // namespace rackrun::cli
