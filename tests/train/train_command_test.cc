// End-to-end tests of `rackrun data` and `rackrun train`: run the built binary in a child
// process and check exit codes, printed lines, JSON Lines logs and resumption.

#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/process.h"
#include "tests/support/shell.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

using Result = ::rackrun::testing::ShellResult;
using ::rackrun::testing::Lines;
using ::rackrun::testing::Slurp;

// A fresh folder per test: CTest runs the tests of this file in parallel processes.
fs::path Dir() { return ::rackrun::testing::ScratchDir("train_command_"); }

Result Rackrun(const std::string& args) {
  fs::create_directories(Dir());
  return ::rackrun::testing::Shell(std::string(RACKRUN_BINARY) + " " + args, Dir() / "stdout.txt",
                                   Dir() / "stderr.txt");
}

// Tokenizes the Brown sample into Dir()/data and writes a tiny spec; returns the spec path.
std::string PrepareJob() {
  fs::remove_all(Dir());
  fs::create_directories(Dir());
  const Result data = Rackrun(std::string("data --input ") + RACKRUN_SOURCE_DIR +
                              "/tests/data/brown-sample.txt --output " + (Dir() / "data").string() +
                              " --val-fraction 0.1");
  EXPECT_EQ(data.code, 0) << data.err;
  const fs::path spec = Dir() / "tiny.yaml";
  std::ofstream(spec) << "model: {width: 16, blocks: 1, heads: 2, seq_len: 16, residual: xhc,\n"
                         "        streams: 4, active: 2, fixed: 1,\n"
                         "        moe: {experts: 4, top_k: 2, expert_hidden: 16}}\n"
                         "data: {train: data/brown-sample, validation: data/brown-sample-val,\n"
                         "       batch_size: 2}\n"
                         "training: {steps: 6, seed: 9, eval_interval: 3, eval_batches: 2}\n"
                         "logging: {interval: 1}\n"
                         "resources: {threads: 1}\n";
  return spec.string();
}

TEST(DataCommandTest, WritesAMegatronDatasetPerInput) {
  PrepareJob();
  const Result r = Rackrun(std::string("data --input ") + RACKRUN_SOURCE_DIR +
                           "/tests/data/brown-sample.txt --output " + (Dir() / "again").string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("train       24 documents"));  // 5%: every 20th to validation
  EXPECT_THAT(r.out, HasSubstr("val          1 documents"));
  EXPECT_THAT(r.out, HasSubstr("unigram entropy"));
  EXPECT_THAT(r.out, HasSubstr("tokenizer bytes (vocab 257)"));
  for (const char* file : {"brown-sample.bin", "brown-sample.idx", "brown-sample.meta.json",
                           "brown-sample-val.bin", "brown-sample-val.idx"}) {
    EXPECT_TRUE(fs::exists(Dir() / "again" / file)) << file;
  }
  EXPECT_GT(fs::file_size(Dir() / "again" / "brown-sample.bin"), 80000u);  // uint16 ids
  // The progress bar (on by itself when stderr is a terminal).
  const Result shown =
      Rackrun(std::string("data --progress always --input ") + RACKRUN_SOURCE_DIR +
              "/tests/data/brown-sample.txt --output " + (Dir() / "shown").string());
  ASSERT_EQ(shown.code, 0) << shown.err;
  EXPECT_THAT(shown.err, ::testing::ContainsRegex("brown-sample \\[#+\\] 100%  [0-9.]+ MB/s"));
  const Result bad = Rackrun("data --input /nonexistent.txt --output " + (Dir() / "x").string());
  EXPECT_EQ(bad.code, 1);
  EXPECT_THAT(bad.err, HasSubstr("/nonexistent.txt"));
  EXPECT_EQ(Rackrun("data --output x").code, 2);
}

// JSON Lines with --json-key, and each bad input named by file and line, leaving no dataset.
TEST(DataCommandTest, ReadsJsonLinesAndNamesBadLines) {
  PrepareJob();
  const fs::path in = Dir() / "docs.jsonl";
  {
    std::ofstream out(in);
    for (int i = 0; i < 50; ++i) out << "{\"body\": \"document " << i << " says hello\"}\n";
  }
  Result r = Rackrun("data --input " + in.string() + " --json-key body --val-fraction 0 --output " +
                     (Dir() / "j").string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("train       50 documents"));
  EXPECT_TRUE(fs::exists(Dir() / "j" / "docs.idx"));
  EXPECT_FALSE(fs::exists(Dir() / "j" / "docs-val.idx"));
  struct Case {
    std::string line;
    std::string flags;
    std::string expected;
  };
  const Case cases[] = {
      {"{\"body\": \"cut", "--json-key body", ":51: malformed JSON"},
      {"{\"text\": \"x\"}", "--json-key body", ":51: no key \"body\" (the object has \"text\")"},
      {"{\"body\": \"\xff\"}", "--json-key body", ":51: invalid UTF-8 (byte 0xff"},
  };
  for (const Case& c : cases) {
    std::ofstream(in, std::ios::app) << c.line << "\n";
    fs::remove_all(Dir() / "bad");
    r = Rackrun("data --input " + in.string() + " " + c.flags + " --output " +
                (Dir() / "bad").string());
    EXPECT_EQ(r.code, 1) << c.line;
    EXPECT_THAT(r.err, HasSubstr(in.string() + c.expected));
    EXPECT_TRUE(fs::is_empty(Dir() / "bad")) << "a half-written dataset was left";
    // Drop the bad line again.
    std::string text = ::rackrun::testing::Slurp(in);
    text.resize(text.rfind('\n', text.size() - 2) + 1);
    std::ofstream(in, std::ios::trunc) << text;
  }
  // --invalid-utf8 skip drops the document and says so.
  std::ofstream(in, std::ios::app) << "{\"body\": \"\xff\"}\n";
  r = Rackrun("data --input " + in.string() + " --json-key body --invalid-utf8 skip --output " +
              (Dir() / "skip").string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("1 documents skipped"));
}

// The way in for a SentencePiece tokenizer: train it, tokenize with it, train a model on it,
// export the weights and import them back into a checkpoint that resumes.
TEST(DataCommandTest, SentencePieceDataTrainsExportsAndImports) {
  const std::string spec = PrepareJob();
  const std::string sample = std::string(RACKRUN_SOURCE_DIR) + "/tests/data/brown-sample.txt";
  const std::string model = (Dir() / "bpe.model").string();
  Result r = Rackrun("data tokenizer --train --input " + sample + " --vocab 400 --output " + model);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("sentencepiece bpe, vocab 400"));
  r = Rackrun("data --input " + sample + " --tokenizer " + model + " --val-fraction 0.1 --output " +
              (Dir() / "spm").string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("tokenizer sentencepiece bpe, vocab 400"));
  const std::string ckpt = (Dir() / "ckpt").string();
  const std::string data =
      " --set data.train=" + (Dir() / "spm" / "brown-sample").string() +
      " --set data.validation=" + (Dir() / "spm" / "brown-sample-val").string();
  r = Rackrun("train " + spec + data + " --set checkpoint.dir=" + ckpt);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("vocab 400"));
  EXPECT_THAT(r.out, HasSubstr("tokenizer sentencepiece bpe, vocab 400"));
  r = Rackrun("export " + ckpt + " --format safetensors --output " + (Dir() / "export").string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("exported step 6"));
  EXPECT_TRUE(fs::exists(Dir() / "export" / "model.safetensors"));
  r = Rackrun("import " + (Dir() / "export").string() + " --output " +
              (Dir() / "imported").string());
  ASSERT_EQ(r.code, 0) << r.err;
  r = Rackrun("train " + spec + data + " --set training.steps=8 --set checkpoint.dir=" +
              (Dir() / "ckpt2").string() + " --resume " + (Dir() / "imported").string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("the training data starts from its first sample"));
  EXPECT_THAT(r.out, HasSubstr("summary: 8 steps (8 this run)"));
  // Bytes data on a checkpoint of SentencePiece data: refused naming both tokenizers.
  r = Rackrun("train " + spec +
              " --set model.vocab=400 --set training.steps=8 --set checkpoint.dir=" +
              (Dir() / "ckpt3").string() + " --resume " + ckpt);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("was trained on data from tokenizer sentencepiece bpe, vocab 400"));
  EXPECT_THAT(r.err, HasSubstr("this job's data is from bytes (vocab 257)"));
}

TEST(TrainCommandTest, TrainsLogsAndSummarises) {
  const std::string spec = PrepareJob();
  const fs::path log = Dir() / "log.jsonl";
  const Result r = Rackrun("train " + spec + " --log-json " + log.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("step 6/6"));
  EXPECT_THAT(r.out, HasSubstr("summary: 6 steps"));
  EXPECT_THAT(r.out, HasSubstr("unigram entropy of the training data"));
  const std::vector<std::string> lines = Lines(log);
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_THAT(lines[2], HasSubstr("\"step\": 3"));
  EXPECT_THAT(lines[2], ::testing::Not(HasSubstr("\"val_loss\": null")));
}

// The kernels that run are printed; kernels older than the CPU supports (the SSE3 set that
// OpenBLAS 0.3.21 gave a CPU newer than its model table) are reported once, with the fix.
TEST(TrainCommandTest, PrintsItsKernelsAndReportsOlderOnesOnce) {
  const std::string spec = PrepareJob();
  const Result r = Rackrun("train " + spec + " --set training.steps=1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("kernels: openblas "));
  EXPECT_THAT(r.out, HasSubstr("GEMM threads: 1, one thread"));
  EXPECT_THAT(r.err, Not(HasSubstr("older than this CPU supports")));

  if (Slurp("/proc/cpuinfo").find(" avx") == std::string::npos) {
    GTEST_SKIP() << "this CPU has no AVX";
  }
  const Result old =
      ::rackrun::testing::Shell("OPENBLAS_CORETYPE=Prescott " + std::string(RACKRUN_BINARY) +
                                    " train " + spec + " --set training.steps=1 --start-over",
                                Dir() / "stdout.txt", Dir() / "stderr.txt");
  ASSERT_EQ(old.code, 0) << old.err;
  EXPECT_THAT(old.out, HasSubstr("kernels: openblas Prescott kernels"));
  const std::string warning = "OpenBLAS runs its Prescott kernels, older than this CPU supports";
  const size_t first = old.err.find(warning);
  ASSERT_NE(first, std::string::npos) << old.err;
  EXPECT_EQ(old.err.find(warning, first + 1), std::string::npos) << "reported twice: " << old.err;
  EXPECT_THAT(old.err, HasSubstr("OPENBLAS_CORETYPE=Prescott asks for them; unset it"));
}

TEST(TrainCommandTest, ResumedRunLogsTheSameLossesAsTheUninterruptedOne) {
  const std::string spec = PrepareJob();
  const fs::path full = Dir() / "full.jsonl";
  const fs::path ckpt = Dir() / "ckpt";
  ASSERT_EQ(Rackrun("train " + spec + " --log-json " + full.string() +
                    " --set checkpoint.interval=4 --set checkpoint.dir=" + ckpt.string())
                .code,
            0);
  // Resume the same spec from its step-4 checkpoint (kept beside the final one).
  const fs::path resumed = Dir() / "resumed.jsonl";
  const std::string step4 = (ckpt / "step-00000004.ckpt").string();
  const Result r =
      Rackrun("train " + spec + " --resume " + step4 + " --log-json " + resumed.string() +
              " --set checkpoint.dir=" + (Dir() / "ckpt2").string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("resumed at step 4"));
  const std::vector<std::string> a = Lines(full);
  const std::vector<std::string> b = Lines(resumed);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 2u);
  // Step, loss and validation loss (9 significant digits) match; timings differ.
  for (size_t i = 0; i < 2; ++i) {
    const std::string& x = a[4 + i];
    const std::string& y = b[i];
    EXPECT_EQ(x.substr(0, x.find(", \"tokens_per_s\"")), y.substr(0, y.find(", \"tokens_per_s\"")));
  }
}

TEST(TrainCommandTest, LoadTraceRecordsEveryMicrobatchOfOneProcess) {
  const std::string spec = PrepareJob();
  const fs::path trace = Dir() / "loads.jsonl";
  const Result r = Rackrun("train " + spec + " --load-trace " + trace.string() +
                           " --set training.microbatches=2");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<std::string> lines = Lines(trace);
  ASSERT_EQ(lines.size(), 6u * 2u * 1u);  // steps x microbatches x MoE layers
  // One process is one source rank; every routed slot (batch 2 x seq 16 x top-2) counted.
  EXPECT_THAT(lines[0], HasSubstr("\"microbatch\": 0, \"layer\": 0, \"ranks\": 1, \"experts\": 4"));
  EXPECT_THAT(lines.back(), HasSubstr("\"microbatch\": 11, \"layer\": 0"));
  for (const std::string& line : lines) {
    const std::string loads = line.substr(line.find("[[") + 2);
    int64_t sum = 0;
    for (size_t at = 0; at < loads.size() && loads[at] != ']';) {
      size_t used = 0;
      sum += std::stoll(loads.substr(at), &used);
      at += used + 1;  // the number and its comma
    }
    EXPECT_EQ(sum, 2 * 16 * 2) << line;
  }
  const Result replay = Rackrun("plan --trace " + trace.string() + " --slots 0");
  EXPECT_EQ(replay.code, 0) << replay.err;
  const Result bad =
      Rackrun("train " + spec + " --load-trace " + (Dir() / "missing" / "t.jsonl").string());
  EXPECT_NE(bad.code, 0);
  EXPECT_THAT(bad.err, HasSubstr("logging.load_trace"));
}

TEST(TrainCommandTest, SpecErrorsNameTheFieldAndExitNonZero) {
  const std::string spec = PrepareJob();
  Result r = Rackrun("train " + spec + " --set model.moe.topk=3");
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("model.moe.topk: unknown field; did you mean 'top_k'?"));
  r = Rackrun("train " + spec + " --set model.moe.top_k=5");
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("model.moe.top_k: top_k 5 must lie in [1, experts = 4]"));
  r = Rackrun("train " + spec + " --set model.active=5");
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("model.active:"));
  r = Rackrun("train " + (Dir() / "missing.yaml").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("missing.yaml"));
  EXPECT_EQ(Rackrun("train").code, 2);
}

// Issue #12: a spec too large for this machine is refused before anything is allocated,
// with the field, the estimate and the machine's memory; no abort, bounded memory.
TEST(TrainCommandTest, SpecTooLargeForThisMachineIsRefusedWithTheEstimate) {
  const std::string spec = PrepareJob();
  for (const std::string& set :
       {std::string("model.vocab=100000000"), std::string("model.moe.expert_hidden=400000000"),
        std::string("data.batch_size=4000000")}) {
    const Result r = Rackrun("train " + spec + " --set " + set);
    EXPECT_EQ(r.code, 1) << set << ": " << r.err;  // -1 would be a signal (SIGABRT)
    const std::string field = set.substr(0, set.find('='));
    EXPECT_THAT(r.err, HasSubstr("the job needs an estimated ")) << r.err;
    EXPECT_THAT(r.err.substr(0, r.err.find(": the job")), HasSubstr(field)) << r.err;
    EXPECT_THAT(r.err, HasSubstr("but this machine has ")) << r.err;
    EXPECT_THAT(r.err, HasSubstr("MemTotal")) << r.err;
    EXPECT_THAT(r.err, ::testing::Not(HasSubstr("terminate"))) << r.err;
  }
  // Sizes no machine holds are refused by the spec check itself (also at submit).
  const Result huge = Rackrun("train " + spec + " --set model.vocab=2000000000 --set " +
                              "model.width=2000000 --set model.moe.expert_hidden=16");
  EXPECT_EQ(huge.code, 1) << huge.err;
  EXPECT_THAT(huge.err, HasSubstr("model.vocab, model.width: the job would need an estimated"));
  EXPECT_THAT(huge.err, HasSubstr("beyond any machine"));
  // The refused runs never grew: the largest child (rackrun data included) stayed small.
  struct rusage usage {};
  ASSERT_EQ(getrusage(RUSAGE_CHILDREN, &usage), 0);
  EXPECT_LT(usage.ru_maxrss, 200 * 1024) << "KiB";
}

// An allocation that fails although the estimate fit (here: an address-space limit
// below what the job needs) ends rackrun with a message and exit 1, not SIGABRT.
TEST(TrainCommandTest, AllocationFailureIsAMessageNotAnAbort) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ulimit -v leaves AddressSanitizer no room for its shadow memory";
#endif
  std::ifstream meminfo("/proc/meminfo");
  int64_t available_kib = 0;
  for (std::string line; std::getline(meminfo, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) available_kib = std::stoll(line.substr(13));
  }
  if (available_kib < 3ll << 20) GTEST_SKIP() << "needs 3 GiB available to pass the estimate";
  const std::string spec = PrepareJob();
  // vocab 2,000,000: about 1.2 GiB estimated (fits), but ulimit -v allows 1 GB.
  const Result r =
      ::rackrun::testing::Shell("ulimit -v 1000000 && " + std::string(RACKRUN_BINARY) + " train " +
                                    spec + " --set model.vocab=2000000 --set training.steps=2",
                                Dir() / "stdout.txt", Dir() / "stderr.txt");
  EXPECT_EQ(r.code, 1) << r.err;  // -1: killed by a signal
  EXPECT_THAT(r.err, HasSubstr("rackrun train: out of memory: an allocation failed"));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("terminate called")));
}

TEST(TrainCommandTest, ThreadsBeyondTheCoresAreRefused) {
  const std::string spec = PrepareJob();
  const Result r = Rackrun("train " + spec + " --set resources.threads=1000");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("resources.threads: 1000 threads per rank"));
  EXPECT_THAT(r.err, HasSubstr("set at most"));
}

// Issue #12: integers are decimal (YAML 1.1 would read 0100 as 64), duplicates and a
// second document are errors.
TEST(TrainCommandTest, SpecScalarsAreStrict) {
  const std::string spec = PrepareJob();
  Result r = Rackrun("train " + spec + " --set training.steps=0100 --print-spec");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"steps\":\"100\""));
  std::ofstream(Dir() / "dup.yaml") << Slurp(spec) << "training: {steps: 3}\n";
  r = Rackrun("train " + (Dir() / "dup.yaml").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("training: given twice"));
  std::ofstream(Dir() / "two.yaml") << Slurp(spec) << "---\nname: other\n";
  r = Rackrun("train " + (Dir() / "two.yaml").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("a second YAML document"));
  r = Rackrun("train " + spec + " --set training.steps=-5");
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("training.steps: is -5; it must be positive"));
}

// SIGTERM (what Slurm sends before it kills a job): the step finishes, a checkpoint of it
// is written and the process exits 0; resuming from it continues the same trajectory.
TEST(TrainCommandTest, SigtermCheckpointsTheCurrentStepAndExitsZero) {
  const std::string spec = PrepareJob();
  const fs::path ckpt = Dir() / "ckpt";
  ::rackrun::testing::Child train(
      {RACKRUN_BINARY, "train", spec, "--set", "training.steps=100000", "--set",
       "checkpoint.dir=" + ckpt.string(), "--set", "checkpoint.interval=100000"},
      Dir() / "train.log");
  std::string text;
  ASSERT_FALSE(
      ::rackrun::testing::WaitForText(Dir() / "train.log", std::regex("step +5/"), &text).empty())
      << text;
  train.Signal(SIGTERM);
  EXPECT_EQ(train.Wait(std::chrono::seconds(60)), 0);
  text = ::rackrun::testing::Slurp(Dir() / "train.log");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(text, m, std::regex("stopped by a signal at step ([0-9]+)")))
      << text;
  const int step = std::stoi(m[1].str());
  EXPECT_GE(step, 5);
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08d.ckpt", step);
  EXPECT_TRUE(fs::exists(ckpt / name)) << text;
  const Result resumed = Rackrun("train " + spec + " --resume " + ckpt.string() +
                                 " --set training.steps=" + std::to_string(step + 2));
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_THAT(resumed.out, HasSubstr("resumed at step " + std::to_string(step)));
}

// A folder belongs to one run: a fresh run into another run's checkpoints is refused and
// leaves them untouched; --start-over moves them aside; --resume continues them.
TEST(TrainCommandTest, AFreshRunIntoAnotherRunsFolderIsRefusedUnlessItStartsOver) {
  const std::string spec = PrepareJob();
  const std::string ckpt = (Dir() / "ckpt").string();
  ASSERT_EQ(Rackrun("train " + spec + " --set checkpoint.dir=" + ckpt).code, 0);
  const std::string first = ::rackrun::testing::Slurp(fs::path(ckpt) / "step-00000006.ckpt");
  Result r = Rackrun("train " + spec + " --set checkpoint.dir=" + ckpt + " --set training.seed=5");
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("already holds checkpoints of another run (step-00000006.ckpt)"));
  EXPECT_THAT(r.err, HasSubstr("--resume " + ckpt));
  EXPECT_THAT(r.err, HasSubstr("--start-over"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("step 1/")));
  EXPECT_EQ(::rackrun::testing::Slurp(fs::path(ckpt) / "step-00000006.ckpt"), first);

  r = Rackrun("train " + spec + " --set checkpoint.dir=" + ckpt +
              " --set training.seed=5 --start-over");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("note: checkpoint.start_over: moved step-00000006.ckpt"));
  bool found = false;
  for (const fs::directory_entry& e : fs::directory_iterator(ckpt)) {
    if (e.path().filename().string().rfind("previous-", 0) == 0) {
      found = true;
      EXPECT_EQ(::rackrun::testing::Slurp(e.path() / "step-00000006.ckpt"), first);
    }
  }
  EXPECT_TRUE(found);
  EXPECT_NE(::rackrun::testing::Slurp(fs::path(ckpt) / "step-00000006.ckpt"), first);
  // The help names both switches.
  r = Rackrun("train --help");
  EXPECT_THAT(r.out, HasSubstr("--start-over"));
  EXPECT_THAT(r.out, HasSubstr("DIR/LOCK"));
}

// Two runs on one folder at the same time: the second is refused with the first's pid.
TEST(TrainCommandTest, ASecondRunOnTheSameFolderIsRefusedNamingTheFirst) {
  const std::string spec = PrepareJob();
  const fs::path ckpt = Dir() / "ckpt";
  ::rackrun::testing::Child first(
      {RACKRUN_BINARY, "train", spec, "--set", "training.steps=100000", "--set",
       "checkpoint.dir=" + ckpt.string(), "--set", "checkpoint.interval=100000"},
      Dir() / "first.log");
  std::string text;
  ASSERT_FALSE(
      ::rackrun::testing::WaitForText(Dir() / "first.log", std::regex("step +2/"), &text).empty())
      << text;
  const Result second =
      Rackrun("train " + spec + " --set checkpoint.dir=" + ckpt.string() + " --start-over");
  first.Signal(SIGTERM);
  EXPECT_EQ(first.Wait(std::chrono::seconds(60)), 0);
  EXPECT_EQ(second.code, 1);
  EXPECT_THAT(second.err,
              HasSubstr("is in use by pid " + std::to_string(first.pid()) + " on host"));
  EXPECT_THAT(second.out, ::testing::Not(HasSubstr("step 1/")));
}

TEST(TrainCommandTest, OutputPathsAreCheckedBeforeTheFirstStep) {
  const std::string spec = PrepareJob();
  std::ofstream(Dir() / "file") << "x";
  Result r = Rackrun("train " + spec + " --set checkpoint.dir=" + (Dir() / "file").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("checkpoint.dir: '" + (Dir() / "file").string() +
                               "' exists and is not a folder"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("step 1/")));
  r = Rackrun("train " + spec + " --log-json " + (Dir() / "file" / "log.jsonl").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err,
              HasSubstr("logging.json: cannot open '" + (Dir() / "file" / "log.jsonl").string()));
  EXPECT_THAT(r.err, HasSubstr("Not a directory"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("step 1/")));
}

TEST(TrainCommandTest, ASpecPassedToResumeIsNamedAsNotACheckpoint) {
  const std::string spec = PrepareJob();
  const Result r = Rackrun("train " + spec + " --resume " + spec);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("'" + spec + "' is not a rackrun checkpoint"));
  EXPECT_THAT(r.err, HasSubstr("perhaps a job spec"));
}

// A writer killed with -9 mid-checkpoint leaves step-N.ckpt.tmp-PID; the next start in the
// folder removes it (its writer is gone) and says so.
TEST(TrainCommandTest, TemporariesOfAKilledCheckpointWriterAreRemovedAtTheNextStart) {
  const std::string spec = PrepareJob();
  const fs::path ckpt = Dir() / "ckpt";
  ASSERT_EQ(
      Rackrun("train " + spec + " --set training.steps=3 --set checkpoint.dir=" + ckpt.string())
          .code,
      0);
  // The temporary of a writer that died: take the pid of a finished process.
  ::rackrun::testing::Child dead({"/bin/true"}, Dir() / "true.log");
  dead.Wait(std::chrono::seconds(10));
  const fs::path tmp = ckpt / ("step-00000004.ckpt.tmp-" + std::to_string(dead.pid()));
  std::ofstream(tmp) << "half a checkpoint";
  const Result r = Rackrun("train " + spec + " --resume " + ckpt.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out,
              HasSubstr("note: removed 1 temporary file(s) of a checkpoint writer that died: " +
                        tmp.filename().string()));
  EXPECT_FALSE(fs::exists(tmp));
}

// A full file system (a 8 KiB tmpfs in a private mount namespace; needs root): the log
// fails with its file and ENOSPC, the run exits non-zero at once, and the log holds only
// whole records.
TEST(TrainCommandTest, AFullDiskFailsTheRunNamingTheFileAndKeepsWholeRecords) {
  if (std::system("unshare -m true 2>/dev/null") != 0) {
    GTEST_SKIP() << "unshare -m is not permitted here (needs root)";
  }
  const std::string spec = PrepareJob();
  const fs::path mnt = Dir() / "tiny";
  fs::create_directories(mnt);
  const fs::path copy = Dir() / "log-copy.jsonl";
  const std::string script =
      "mount -t tmpfs -o size=8k tmpfs " + mnt.string() + " && head -c 4096 /dev/zero > " +
      mnt.string() + "/filler && " + RACKRUN_BINARY + " train " + spec +
      " --set training.steps=40 --log-json " + (mnt / "log.jsonl").string() + "; rc=$?; cp " +
      (mnt / "log.jsonl").string() + " " + copy.string() + "; exit $rc";
  const Result full = ::rackrun::testing::Shell("unshare -m sh -c '" + script + "'",
                                                Dir() / "full.out", Dir() / "full.err");
  EXPECT_EQ(full.code, 1) << full.err;
  EXPECT_THAT(full.err, HasSubstr("logging.json: cannot write '" + (mnt / "log.jsonl").string() +
                                  "': No space left on device"));
  EXPECT_THAT(full.out, ::testing::Not(HasSubstr("step 40/40")));
  const std::string log = ::rackrun::testing::Slurp(copy);
  ASSERT_FALSE(log.empty());
  EXPECT_EQ(log.back(), '\n');
  for (const std::string& line : Lines(copy)) {
    EXPECT_EQ(line.rfind("{\"step\": ", 0), 0u) << line;
    EXPECT_EQ(line.back(), '}') << line;
  }
  // A checkpoint that does not fit (about 180 KB into 64 KiB): the error names the file and
  // ENOSPC, and neither a checkpoint nor its temporary is left.
  const fs::path listing = Dir() / "listing.txt";
  const std::string ckpt_script =
      "mount -t tmpfs -o size=64k tmpfs " + mnt.string() + " && " + RACKRUN_BINARY + " train " +
      spec + " --set training.steps=2 --set checkpoint.dir=" + (mnt / "ckpt").string() +
      "; rc=$?; ls -A " + (mnt / "ckpt").string() + " > " + listing.string() + "; exit $rc";
  const Result ckpt = ::rackrun::testing::Shell("unshare -m sh -c '" + ckpt_script + "'",
                                                Dir() / "ckpt.out", Dir() / "ckpt.err");
  EXPECT_EQ(ckpt.code, 1) << ckpt.err;
  EXPECT_THAT(ckpt.err, HasSubstr("cannot write '" +
                                  (mnt / "ckpt" / "step-00000002.ckpt").string() + ".tmp-"));
  EXPECT_THAT(ckpt.err, HasSubstr("No space left on device"));
  EXPECT_EQ(Lines(listing), (std::vector<std::string>{"LOCK", "OWNER"}));
}

}  // namespace
