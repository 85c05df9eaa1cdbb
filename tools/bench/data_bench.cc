// The data path's costs, side by side in one run:
//  1. `rackrun data` (data::PrepareDataset, the command's pipeline) tokenizing text with a
//     SentencePiece BPE model on 1 thread and on every core, against Debian's spm_encode CLI
//     on the same input and model (one process, one core): MB of text per second per core.
//  2. The loader (data::Loader) per microbatch at the demo model's shape (seq 128 x batch 8)
//     and at seq 4096 x batch 64, against the demo model's measured training step.
//
//   bench_data_bench [--json] [--input TEXT] [--model M.model] [--vocab 4096] [--reps 3]
//
// The input defaults to the Brown corpus (out/corpus/brown/brown.txt, tools/fetch-corpus),
// else the committed sample; the model is trained on it when not given (vocab 4096, BPE).
// Every figure is the median of --reps runs, the runs of the contenders alternated.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "base/file.h"
#include "base/statistics.h"
#include "data/loader.h"
#include "data/prepare.h"
#include "data/tokenizer.h"
#include "jobspec/spec.h"
#include "nlohmann/json.hpp"
#include "runtime/trainer.h"
#include "tools/bench/startup.h"

namespace {

namespace fs = std::filesystem;
namespace data = rackrun::data;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// spm_encode over `input` (ids to /dev/null): its wall seconds, or -1 when it failed.
double SpmEncodeSeconds(const std::string& model, const std::string& input) {
  const Clock::time_point start = Clock::now();
  const std::string command =
      "spm_encode --model=" + model + " --output_format=id < " + input + " > /dev/null 2>&1";
  if (std::system(command.c_str()) != 0) return -1;
  return Seconds(start);
}

struct Options {
  std::string input, model, scratch = "out/bench-data";
  int vocab = 4096, reps = 3, threads = 0;
};

// Trains the BPE model o.model on the input (vocab o.vocab); false, said on stderr, when it
// failed.
bool TrainModel(const Options& o, const std::string& program) {
  std::vector<std::string> lines;
  for (absl::string_view l :
       absl::StrSplit(*rackrun::base::ReadWholeFile(o.input), '\n', absl::SkipWhitespace())) {
    if (l != "\f") lines.emplace_back(l);
  }
  size_t next = 0;
  const absl::Status s = data::TrainSentencePiece(
      {.output = o.model, .vocab_size = o.vocab, .model_type = "bpe"}, [&](std::string* out) {
        if (next >= lines.size()) return false;
        *out = lines[next++];
        return true;
      });
  if (!s.ok()) {
    std::fprintf(stderr, "%s: training the model: %s\n", program.c_str(),
                 std::string(s.message()).c_str());
    return false;
  }
  return true;
}

struct LoaderCase {
  const char* name;
  int seq, batch, microbatches;
  double seconds = 0;
};

// The loader's seconds per microbatch of each case, median of o.reps runs.
absl::Status TimeLoaders(const Options& o, std::vector<LoaderCase>& loader_cases) {
  for (LoaderCase& c : loader_cases) {
    absl::StatusOr<std::unique_ptr<data::Loader>> l =
        data::Loader::Create({{1, o.scratch + "/prepared"}}, {.seq_len = c.seq,
                                                              .batch = c.batch,
                                                              .seed = 1,
                                                              .shuffle = true,
                                                              .vocab = 0,
                                                              .field = "bench"});
    if (!l.ok()) return l.status();
    data::Batch b;
    std::vector<double> per;
    for (int r = 0; r < o.reps; ++r) {
      const Clock::time_point start = Clock::now();
      for (int i = 0; i < c.microbatches; ++i) (void)(*l)->Next(b);
      per.push_back(Seconds(start) / c.microbatches);
    }
    c.seconds = rackrun::base::Median(per);
  }
  return absl::OkStatus();
}

// The demo model's step on the same data (examples/tiny-moe.yaml): 10 timed after 2.
absl::StatusOr<double> DemoStepSeconds(const Options& o, int cores) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = rackrun::jobspec::LoadJobSpec(
      std::string(RACKRUN_SOURCE_DIR) + "/examples/tiny-moe.yaml",
      {"data.train=" + o.scratch + "/prepared", "data.validation=", "checkpoint.dir=",
       "model.vocab=0", "training.steps=12", "resources.threads=" + std::to_string(cores)});
  absl::StatusOr<std::unique_ptr<rackrun::runtime::Trainer>> t =
      spec.ok() ? rackrun::runtime::Trainer::Create(*spec)
                : absl::StatusOr<std::unique_ptr<rackrun::runtime::Trainer>>(spec.status());
  if (!t.ok()) return t.status();
  for (int i = 0; i < 2; ++i) (void)(*t)->Step();  // warm-up: workspaces sized
  std::vector<double> steps;
  for (int i = 0; i < 10; ++i) {
    const Clock::time_point start = Clock::now();
    (void)(*t)->Step();
    steps.push_back(Seconds(start));
  }
  return rackrun::base::Median(steps);
}

// What both outputs print.
struct Figures {
  const Options& o;
  std::string tokenizer;  // its description
  double mb;              // of input text
  int64_t tokens;
  int cores;
  double t1, tn, ts;  // median seconds: rackrun data on 1 thread, on `cores`; spm_encode
  bool have_spm;
  const std::vector<LoaderCase>& loader_cases;
  double step_s;                // the demo model's step
  double demo_loader_per_step;  // 1 microbatch per step
};

void PrintJson(const Figures& f) {
  nlohmann::json j = {
      {"machine", rackrun::bench::MachineLine()},
      {"input", f.o.input},
      {"input_mb", f.mb},
      {"model", f.o.model},
      {"tokenizer", f.tokenizer},
      {"tokens", f.tokens},
      {"cores", f.cores},
      {"reps", f.o.reps},
      {"rackrun_data_1_thread_mb_per_s", f.mb / f.t1},
      {"rackrun_data_all_threads_mb_per_s", f.mb / f.tn},
      {"rackrun_data_all_threads_mb_per_s_per_core", f.mb / f.tn / f.cores},
      {"spm_encode_mb_per_s", f.have_spm ? nlohmann::json(f.mb / f.ts) : nlohmann::json(nullptr)},
      {"per_core_ratio_vs_spm_encode",
       f.have_spm ? nlohmann::json(f.ts / f.t1) : nlohmann::json(nullptr)},
      {"demo_step_s", f.step_s},
      {"demo_loader_share_of_step", f.demo_loader_per_step / f.step_s}};
  for (const LoaderCase& c : f.loader_cases) {
    j["loader"].push_back({{"shape", c.name},
                           {"seq_len", c.seq},
                           {"batch", c.batch},
                           {"microbatch_s", c.seconds},
                           {"tokens_per_s", c.seq * c.batch / c.seconds}});
  }
  std::printf("%s\n", j.dump(2).c_str());
}

void PrintTables(const Figures& f) {
  std::printf("machine: %s\n", rackrun::bench::MachineLine().c_str());
  std::printf("input %s: %.1f MB, %lld tokens with %s; median of %d runs\n\n", f.o.input.c_str(),
              f.mb, static_cast<long long>(f.tokens), f.tokenizer.c_str(), f.o.reps);
  std::printf("%-34s %10s %14s\n", "tokenizing", "MB/s", "MB/s per core");
  std::printf("%-34s %10.2f %14.2f\n", "rackrun data, 1 thread", f.mb / f.t1, f.mb / f.t1);
  std::printf("%-34s %10.2f %14.2f\n",
              ("rackrun data, " + std::to_string(f.cores) + " threads").c_str(), f.mb / f.tn,
              f.mb / f.tn / f.cores);
  if (f.have_spm) {
    std::printf("%-34s %10.2f %14.2f\n", "spm_encode (one process)", f.mb / f.ts, f.mb / f.ts);
    std::printf("per core, rackrun data / spm_encode: %.2fx\n", f.ts / f.t1);
  } else {
    std::printf("spm_encode: not installed (tools/setup installs the sentencepiece package)\n");
  }
  std::printf("\n%-28s %14s %14s\n", "loader", "per microbatch", "tokens/s");
  for (const LoaderCase& c : f.loader_cases) {
    std::printf("%-28s %11.1f us %14.3g\n", c.name, 1e6 * c.seconds, c.seq * c.batch / c.seconds);
  }
  std::printf(
      "demo model step (examples/tiny-moe.yaml, %d threads): %.1f ms; the loader is %.3f%% "
      "of it\n",
      f.cores, 1e3 * f.step_s, 100 * f.demo_loader_per_step / f.step_s);
}

}  // namespace

int main(int argc, char** argv) {
  rackrun::bench::BenchStartup bench(argc, argv,
                                     "rackrun data's tokenizing throughput against spm_encode, "
                                     "and the loader's cost per step",
                                     {.passive_openmp_wait = true});
  Options o;
  bench.flags().String("--input", &o.input, "TEXT", "text to tokenize (default: the Brown corpus)");
  bench.flags().String("--model", &o.model, "M.model",
                       "SentencePiece model (default: trained here)");
  bench.flags().Int("--vocab", &o.vocab, "N", "vocabulary of the model trained here").Range(64);
  bench.flags().Int("--reps", &o.reps, "N", "repetitions per figure (median)").Range(1);
  bench.flags()
      .Int("--threads", &o.threads, "N", "threads of the parallel run (0 = every core)")
      .Range(0);
  bench.flags().String("--scratch", &o.scratch, "DIR", "folder for the model and the datasets");
  if (std::optional<int> exit = bench.Start()) return *exit;
  const int cores =
      o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency());
  if (o.input.empty()) {
    o.input = fs::exists("out/corpus/brown/brown.txt")
                  ? "out/corpus/brown/brown.txt"
                  : std::string(RACKRUN_SOURCE_DIR) + "/tests/data/brown-sample.txt";
  }
  fs::create_directories(o.scratch);
  const int64_t bytes = static_cast<int64_t>(fs::file_size(o.input));
  if (o.model.empty()) {
    o.model = o.scratch + "/bpe.model";
    if (!TrainModel(o, bench.program())) return 1;
  }
  absl::StatusOr<std::unique_ptr<data::Tokenizer>> tokenizer = data::OpenTokenizer(o.model);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s: %s\n", bench.program().c_str(),
                 std::string(tokenizer.status().message()).c_str());
    return 1;
  }
  const bool have_spm = std::system("command -v spm_encode >/dev/null 2>&1") == 0;

  // 1. Tokenizing throughput.
  std::vector<double> ours1, oursn, spm;
  int64_t tokens = 0;
  for (int r = 0; r < o.reps; ++r) {
    for (const int threads : {1, cores}) {
      absl::StatusOr<data::PrepareResult> p =
          data::PrepareDataset(o.input, o.scratch + "/prepared", "",
                               {.tokenizer = tokenizer->get(), .threads = threads});
      if (!p.ok()) {
        std::fprintf(stderr, "%s: %s\n", bench.program().c_str(),
                     std::string(p.status().message()).c_str());
        return 1;
      }
      tokens = p->train.info.tokens;
      (threads == 1 ? ours1 : oursn).push_back(p->seconds);
    }
    if (have_spm) spm.push_back(SpmEncodeSeconds(o.model, o.input));
  }
  const double mb = static_cast<double>(bytes) / 1e6;
  const double t1 = rackrun::base::Median(ours1), tn = rackrun::base::Median(oursn);
  const double ts = have_spm ? rackrun::base::Median(spm) : 0;

  // 2. The loader per microbatch, on the dataset just written (page cache warm).
  std::vector<LoaderCase> loader_cases = {{"demo (seq 128 x batch 8)", 128, 8, 2000},
                                          {"seq 4096 x batch 64", 4096, 64, 50}};
  if (absl::Status s = TimeLoaders(o, loader_cases); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", bench.program().c_str(), std::string(s.message()).c_str());
    return 1;
  }
  const absl::StatusOr<double> demo_step = DemoStepSeconds(o, cores);
  if (!demo_step.ok()) {
    std::fprintf(stderr, "%s: the demo step: %s\n", bench.program().c_str(),
                 std::string(demo_step.status().message()).c_str());
    return 1;
  }
  const double step_s = *demo_step;
  const double demo_loader_per_step = loader_cases[0].seconds;  // 1 microbatch per step

  const Figures figures{.o = o,
                        .tokenizer = (*tokenizer)->info().Describe(),
                        .mb = mb,
                        .tokens = tokens,
                        .cores = cores,
                        .t1 = t1,
                        .tn = tn,
                        .ts = ts,
                        .have_spm = have_spm,
                        .loader_cases = loader_cases,
                        .step_s = step_s,
                        .demo_loader_per_step = demo_loader_per_step};
  if (bench.json()) {
    PrintJson(figures);
  } else {
    PrintTables(figures);
  }
  return 0;
}
