#include "runtime/trainer.h"

#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/forwarding_channel.h"
#include "comm/inprocess_channel.h"
#include "data/prepare.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jobspec/spec.h"
#include "runtime/checkpoint.h"
#include "runtime/device_engine.h"
#include "runtime/expert_instances.h"
#include "runtime/optimizer.h"
#include "runtime/test_util.h"
#include "runtime/training_session.h"

namespace rackrun::runtime {
namespace {

using ::testing::HasSubstr;

namespace fs = std::filesystem;

// Datasets of the committed Brown sample (byte-level, 10% validation), made once per test
// binary: DataDir()/brown and DataDir()/brown-val.
const fs::path& DataDir() {
  static const fs::path dir = [] {
    const fs::path sample = fs::path(RACKRUN_SOURCE_DIR) / "tests" / "data" / "brown-sample.txt";
    // One folder per process: CTest runs the tests of this binary side by side.
    const fs::path out =
        fs::path(::testing::TempDir()) / ("trainer_test_data-" + std::to_string(getpid()));
    fs::create_directories(out);
    const std::unique_ptr<data::Tokenizer> bytes = *data::OpenTokenizer("bytes");
    absl::StatusOr<data::PrepareResult> r = data::PrepareDataset(
        sample.string(), (out / "brown").string(), (out / "brown-val").string(),
        {.tokenizer = bytes.get(), .val_fraction = 0.1, .threads = 1});
    EXPECT_TRUE(r.ok()) << r.status();
    return out;
  }();
  return dir;
}

fs::path FreshDir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / "trainer_test" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A tiny xhc MoE model: a step takes milliseconds.
rackrun::v1::JobSpec TinySpec(std::vector<std::string> overrides = {}) {
  const std::string yaml = R"(
name: tiny-test
model: {width: 16, blocks: 2, heads: 2, seq_len: 16, residual: xhc, streams: 4, active: 2,
        fixed: 1, moe: {experts: 4, top_k: 2, expert_hidden: 16, aux_loss_coef: 0.01}}
data: {batch_size: 2}
training: {steps: 8, seed: 3, lr: 0.01, eval_interval: 4, eval_batches: 2}
logging: {interval: 1}
resources: {threads: 1}
)";
  overrides.insert(overrides.begin(), "data.train=" + (DataDir() / "brown").string());
  overrides.insert(overrides.begin() + 1, "data.validation=" + (DataDir() / "brown-val").string());
  absl::StatusOr<rackrun::v1::JobSpec> spec = jobspec::ParseJobSpec(yaml, overrides);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

std::vector<double> Losses(const rackrun::v1::JobSpec& spec) {
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(spec);
  EXPECT_TRUE(t.ok()) << t.status();
  absl::StatusOr<TrainSummary> s = (*t)->Run();
  EXPECT_TRUE(s.ok()) << s.status();
  return s->losses;
}

TEST(TrainerTest, SameSpecGivesBitIdenticalLosses) {
  const rackrun::v1::JobSpec spec = TinySpec();
  const std::vector<double> a = Losses(spec);
  const std::vector<double> b = Losses(spec);
  ASSERT_EQ(a.size(), 8u);
  EXPECT_EQ(a, b);  // exact, not approximate
  EXPECT_NE(a, Losses(TinySpec({"training.seed=4"})));
}

TEST(TrainerTest, ResumeContinuesTheBitIdenticalTrajectory) {
  const fs::path dir = FreshDir("resume");
  const rackrun::v1::JobSpec spec =
      TinySpec({"checkpoint.dir=" + dir.string(), "checkpoint.interval=3"});
  const std::vector<double> full = Losses(spec);  // checkpoints at steps 3, 6, 8
  ASSERT_EQ(full.size(), 8u);
  EXPECT_EQ(ListCheckpoints(dir.string()).size(), 2u);  // keep = 2: steps 6 and 8

  // Resume from step 6 and run to the end.
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(spec);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Resume(CheckpointPath(dir.string(), 6)).ok());
  EXPECT_EQ((*t)->step(), 6);
  absl::StatusOr<TrainSummary> s = (*t)->Run();
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->losses.size(), 2u);
  EXPECT_EQ(s->losses[0], full[6]);
  EXPECT_EQ(s->losses[1], full[7]);
  EXPECT_EQ(s->first_step, 6);
}

TEST(TrainerTest, ResumeAcrossAnEpochBoundaryAndWithAccumulation) {
  // 2 microbatches of 8 sequences per step cross the loader's epoch boundary often
  // enough on this short validation-sized stream to exercise the saved RNG state.
  const fs::path dir = FreshDir("resume_epochs");
  const rackrun::v1::JobSpec spec =
      TinySpec({"data.train=" + (DataDir() / "brown-val").string(),
                "data.validation=", "data.batch_size=8", "training.microbatches=2",
                "training.steps=12", "checkpoint.dir=" + dir.string(), "checkpoint.interval=5"});
  const std::vector<double> full = Losses(spec);
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(spec);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Resume(CheckpointPath(dir.string(), 10)).ok());
  absl::StatusOr<TrainSummary> s = (*t)->Run();
  ASSERT_TRUE(s.ok());
  ASSERT_EQ(s->losses.size(), 2u);
  EXPECT_EQ(s->losses[0], full[10]);
  EXPECT_EQ(s->losses[1], full[11]);
}

TEST(TrainerTest, DamagedCheckpointIsRefusedAndThePreviousOneStillResumes) {
  const fs::path dir = FreshDir("damaged");
  const rackrun::v1::JobSpec spec =
      TinySpec({"checkpoint.dir=" + dir.string(), "checkpoint.interval=4"});
  Losses(spec);
  const std::string newest = CheckpointPath(dir.string(), 8);
  fs::resize_file(newest, fs::file_size(newest) - 100);
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(spec);
  ASSERT_TRUE(t.ok());
  absl::Status s = (*t)->Resume(dir.string());
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr(newest));
  EXPECT_THAT(s.message(), HasSubstr("truncated"));
  EXPECT_THAT(s.message(), HasSubstr(CheckpointPath(dir.string(), 4)));
  EXPECT_TRUE((*t)->Resume(CheckpointPath(dir.string(), 4)).ok());
  EXPECT_EQ((*t)->step(), 4);
}

TEST(TrainerTest, CheckpointOfADifferentModelIsRefused) {
  const fs::path dir = FreshDir("other_model");
  Losses(TinySpec({"checkpoint.dir=" + dir.string(), "training.steps=2"}));
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(TinySpec({"model.moe.experts=8"}));
  ASSERT_TRUE(t.ok());
  absl::Status s = (*t)->Resume(dir.string());
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("different model"));
}

TEST(TrainerTest, AccumulatedMicrobatchesMatchOneLargeBatch) {
  // The loader serves windows in order, so 2 x 2 sequences are the same 4 windows as
  // 1 x 4; the step's loss and gradient agree up to float reassociation.
  absl::StatusOr<std::unique_ptr<Trainer>> a =
      Trainer::Create(TinySpec({"data.batch_size=2", "training.microbatches=2"}));
  absl::StatusOr<std::unique_ptr<Trainer>> b = Trainer::Create(TinySpec({"data.batch_size=4"}));
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<StepRecord> ra = (*a)->Step();
  absl::StatusOr<StepRecord> rb = (*b)->Step();
  ASSERT_TRUE(ra.ok() && rb.ok());
  EXPECT_NEAR(ra->loss, rb->loss, 1e-5);
  EXPECT_NEAR(ra->grad_norm, rb->grad_norm, 1e-4 * rb->grad_norm);
}

TEST(TrainerTest, LearnsBelowTheUnigramEntropy) {
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(
      TinySpec({"model.width=32", "model.seq_len=32", "data.batch_size=8", "training.steps=150",
                "training.lr=0.01", "training.eval_interval=0"}));
  ASSERT_TRUE(t.ok());
  absl::StatusOr<TrainSummary> s = (*t)->Run();
  ASSERT_TRUE(s.ok());
  EXPECT_GT(s->losses.front(), 5.0);  // ~ln(257) at initialisation
  ASSERT_TRUE(s->final_val_loss.has_value());
  EXPECT_LT(s->tail_loss, s->train_unigram_entropy);
  EXPECT_LT(*s->final_val_loss, s->train_unigram_entropy);
}

TEST(TrainerTest, JsonLinesCarryTheDocumentedFields) {
  const fs::path dir = FreshDir("json");
  const std::string log = (dir / "log.jsonl").string();
  Losses(TinySpec({"logging.json=" + log, "logging.interval=2"}));
  std::ifstream in(log);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 4u);  // steps 2, 4 (evaluated), 6, 8 (evaluated)
  for (const char* field :
       {"\"step\": ", "\"loss\": ", "\"val_loss\": ", "\"tokens_per_s\": ", "\"lr\": ",
        "\"grad_norm\": ", "\"elapsed_s\": ", "\"expert_load_max_over_mean\": ["}) {
    EXPECT_THAT(lines[0], HasSubstr(field));
  }
  EXPECT_THAT(lines[0], HasSubstr("\"val_loss\": null"));
  EXPECT_THAT(lines[1], ::testing::Not(HasSubstr("\"val_loss\": null")));
}

TEST(TrainerTest, ThreadCountChangesLossesOnlyWithinTolerance) {
  // Reductions and GEMM splits depend on the thread count, so losses may differ in the
  // last bits; they stay within 1e-4 relative over these steps.
  const std::vector<double> one = Losses(TinySpec({"resources.threads=1"}));
  const std::vector<double> two = Losses(TinySpec({"resources.threads=2"}));
  ASSERT_EQ(one.size(), two.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(one[i], two[i], 1e-4 * one[i]) << i;
  omp_set_num_threads(1);
}

std::vector<std::string> FileLines(const fs::path& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// A JSON log line without its timings (tokens_per_s onwards differ between runs).
std::string Untimed(const std::string& line) {
  return line.substr(0, line.find(", \"tokens_per_s\""));
}

TEST(TrainerTest, ResumeCutsTheLogAndTheLoadTraceBackAndExtendsThem) {
  const fs::path dir = FreshDir("resume_logs");
  const std::string log = (dir / "log.jsonl").string();
  const std::string trace = (dir / "trace.jsonl").string();
  const rackrun::v1::JobSpec spec =
      TinySpec({"checkpoint.dir=" + (dir / "ckpt").string(), "checkpoint.interval=3",
                "logging.json=" + log, "logging.load_trace=" + trace, "training.microbatches=2"});
  Losses(spec);  // checkpoints at 6 and 8; the log and trace run to step 8
  const std::vector<std::string> full_log = FileLines(log);
  const std::string full_trace = *ReadWholeFile(trace);
  ASSERT_EQ(full_log.size(), 8u);
  ASSERT_EQ(FileLines(trace).size(), 8u * 2u * 2u);  // steps x microbatches x MoE layers
  // As after a crash after step 8 whose last checkpoint was step 6: resume from it.
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(spec);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Resume(CheckpointPath((dir / "ckpt").string(), 6)).ok());
  ASSERT_TRUE((*t)->Run().ok());
  const std::vector<std::string> resumed_log = FileLines(log);
  ASSERT_EQ(resumed_log.size(), 8u);  // steps 1..6 kept, 7 and 8 written again, no duplicate
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(Untimed(resumed_log[i]), Untimed(full_log[i])) << i;
  // The loads are deterministic: the extended trace equals the uninterrupted one.
  EXPECT_EQ(*ReadWholeFile(trace), full_trace);
}

TEST(TrainerTest, OutputsAreCheckedBeforeTheFirstStep) {
  const fs::path dir = FreshDir("outputs");
  std::ofstream(dir / "ckpt") << "not a folder";
  absl::StatusOr<std::unique_ptr<Trainer>> t =
      Trainer::Create(TinySpec({"checkpoint.dir=" + (dir / "ckpt").string()}));
  ASSERT_TRUE(t.ok());
  absl::StatusOr<TrainSummary> s = (*t)->Run();
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("checkpoint.dir: '" + (dir / "ckpt").string()));
  EXPECT_EQ((*t)->steps_done(), 0);
  t = Trainer::Create(TinySpec({"logging.load_trace=" + (dir / "missing" / "t.jsonl").string()}));
  ASSERT_TRUE(t.ok());
  s = (*t)->Run();
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("logging.load_trace"));
  EXPECT_THAT(s.status().message(), HasSubstr("No such file or directory"));
  EXPECT_EQ((*t)->steps_done(), 0);
}

TEST(TrainerTest, ALogThatCannotBeWrittenStopsTheRunWithTheFileAndReason) {
  // A file size limit of one byte: every write of a record fails (EFBIG), as every write
  // on a full disk does (ENOSPC; a real one: TrainCommandTest.AFullDiskFails...). SIGXFSZ
  // ignored, so the write fails instead of ending the process.
  const std::string log = (FreshDir("unwritable_log") / "log.jsonl").string();
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(TinySpec({"logging.json=" + log}));
  ASSERT_TRUE(t.ok());
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  void (*previous)(int) = std::signal(SIGXFSZ, SIG_IGN);
  rlimit tiny = before;
  tiny.rlim_cur = 1;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &tiny), 0);
  absl::StatusOr<TrainSummary> s = (*t)->Run();
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, previous);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("logging.json: cannot write '" + log + "'"));
  EXPECT_THAT(s.status().message(), HasSubstr("File too large"));
  EXPECT_EQ((*t)->steps_done(), 1);  // stopped at the first record, not after all steps
  // A device is no log file: /dev/full (where every write fails) is refused before a step.
  absl::StatusOr<std::unique_ptr<Trainer>> device =
      Trainer::Create(TinySpec({"logging.json=/dev/full"}));
  ASSERT_TRUE(device.ok());
  s = (*device)->Run();
  EXPECT_THAT(s.status().message(),
              HasSubstr("logging.json: '/dev/full' is a character device, not a regular file"));
  EXPECT_EQ((*device)->steps_done(), 0);
}

TEST(TrainerTest, AFolderHasOneWriterAndOneRun) {
  const fs::path dir = FreshDir("one_writer");
  const rackrun::v1::JobSpec spec = TinySpec({"checkpoint.dir=" + dir.string()});
  absl::StatusOr<std::unique_ptr<Trainer>> a = Trainer::Create(spec);
  absl::StatusOr<std::unique_ptr<Trainer>> b = Trainer::Create(spec);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Prepare().ok());
  absl::Status s = (*b)->Prepare();
  EXPECT_THAT(s.message(), HasSubstr("in use by pid"));
  ASSERT_TRUE((*a)->Run().ok());  // releases the folder at the end
  // Now the folder holds a's checkpoint: b (a fresh run) is refused, a resumed one is not.
  s = (*b)->Prepare();
  EXPECT_THAT(s.message(), HasSubstr("already holds checkpoints of another run"));
  ASSERT_TRUE((*b)->Resume(dir.string()).ok());
  EXPECT_TRUE((*b)->Prepare().ok());
}

TEST(TrainerTest, BadDataIsAnErrorNamingTheField) {
  absl::StatusOr<std::unique_ptr<Trainer>> t =
      Trainer::Create(TinySpec({"data.train=/nonexistent/train.tokens"}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("data.train: cannot open token file '/nonexistent/train.tokens'"));
  t = Trainer::Create(TinySpec({"model.vocab=100"}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("model.vocab: 100 is smaller than the vocabulary of the training data "
                        "(bytes (vocab 257))"));
}

// rackrun's older token files still train (memory-mapped like the Megatron datasets).
// resources.device: cuda is refused, naming the cause, where this program cannot run it: no
// GPU engine handed in (a build without CUDA). With a factory, the trainer hands it the spec,
// the device and the host model, on one rank or several, and its error (here: the factory's
// own) stops the creation.
TEST(TrainerTest, ACudaJobIsRefusedWhereThisProgramCannotRunIt) {
  const rackrun::v1::JobSpec spec = TinySpec({"resources.device=cuda:0"});
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(spec);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented) << t.status();
  EXPECT_THAT(std::string(t.status().message()),
              HasSubstr("resources.device: cuda:0: this program was built without the GPU "
                        "engine"));

  TrainerOptions options;
  int calls = 0;
  options.device_engine =
      [&](const DeviceEngineSetup& setup) -> absl::StatusOr<std::unique_ptr<DeviceEngine>> {
    ++calls;
    EXPECT_EQ(setup.device.ToString(), "cuda:0");
    EXPECT_EQ(setup.local_rank, 0);
    EXPECT_NE(setup.model, nullptr);
    EXPECT_EQ(setup.spec->resources().device(), "cuda:0");
    return absl::FailedPreconditionError("no GPU in this test");
  };
  t = Trainer::Create(spec, nullptr, options);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(t.status(), absl::FailedPreconditionError("no GPU in this test"));

  // Several ranks (expert parallelism, host-staged): every rank asks the factory for its
  // engine, and its error stops that rank.
  const absl::Status ranks = comm::RunInProcessRanks(2, {}, [&](comm::DataChannel& ch) {
    absl::StatusOr<std::unique_ptr<Trainer>> r = Trainer::Create(spec, &ch, options);
    return r.status();
  });
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(ranks, absl::FailedPreconditionError("no GPU in this test"));

  // resources.device: cuda (no index) is the launcher's local rank's GPU.
  ASSERT_EQ(setenv("LOCAL_RANK", "3", 1), 0);
  int local_rank = -1;
  TrainerOptions local;
  local.device_engine =
      [&](const DeviceEngineSetup& setup) -> absl::StatusOr<std::unique_ptr<DeviceEngine>> {
    local_rank = setup.local_rank;
    EXPECT_EQ(setup.device.GpuFor(setup.local_rank), 3);
    return absl::FailedPreconditionError("no GPU in this test");
  };
  if (std::getenv("OMPI_COMM_WORLD_LOCAL_RANK") == nullptr &&
      std::getenv("SLURM_LOCALID") == nullptr) {
    EXPECT_FALSE(Trainer::Create(TinySpec({"resources.device=cuda"}), nullptr, local).ok());
    EXPECT_EQ(local_rank, 3);
  }
  unsetenv("LOCAL_RANK");

  // The CPU engine never asks for the factory.
  EXPECT_TRUE(Trainer::Create(TinySpec({"resources.device=cpu"}), nullptr, options).ok());
  EXPECT_EQ(calls, 3);
}

// A device engine's seam, exercised without a GPU: an engine that keeps its working copy in a
// second host model (its own AdamW, its own expert-parallel MoE layers through
// HostExpertInstances). A 2-rank job through it takes the path a 2-rank GPU job takes
// (expert-parallel layers from the engine, gradients to the host for the reduction, the norm
// and the clipping, back to the engine with the clipping applied) and must give the CPU
// engine's losses bit for bit: the same arithmetic in the same order.
// With `keeps_gradients` it offers the device-gradient calls (PackGradients, GradSquares,
// ScaleGradients), its own memory standing for the device's: the path of GPU ranks over
// NCCL, where the gradients never cross to the host.
class HostCopyEngine final : public DeviceEngine {
 public:
  static DeviceEngineFactory Factory(bool keeps_gradients) {
    return [keeps_gradients](const DeviceEngineSetup& setup) {
      absl::StatusOr<std::unique_ptr<DeviceEngine>> e = Create(setup);
      if (e.ok()) static_cast<HostCopyEngine&>(**e).keeps_gradients_ = keeps_gradients;
      return e;
    };
  }
  // StoreGradients and LoadGradients calls, by every engine.
  static inline std::atomic<int> host_crossings{0};

  static absl::StatusOr<std::unique_ptr<DeviceEngine>> Create(const DeviceEngineSetup& setup) {
    absl::StatusOr<std::unique_ptr<Model<float>>> m =
        Model<float>::Create(setup.model->config(), /*seed=*/99);  // values copied below
    if (!m.ok()) return m.status();
    auto e = std::unique_ptr<HostCopyEngine>(new HostCopyEngine());
    e->model_ = *std::move(m);
    // The host model's values, as the GPU engine uploads them when it is made.
    Copy(setup.model->Parameters(), e->model_->Parameters(), /*grads=*/false);
    Copy(setup.model->Buffers(), e->model_->Buffers(), false);
    std::vector<OptimizedTensor> tensors;
    for (const ParamRef<float>& p : e->model_->Parameters()) {
      tensors.push_back({p.name, p.value, p.grad, p.size, DecaysWeight(p.name)});
    }
    e->adam_ = std::make_unique<AdamW>(setup.adamw, std::move(tensors));
    return std::unique_ptr<DeviceEngine>(std::move(e));
  }
  std::string Describe() const override { return "host copy"; }
  absl::Status LoadState(Model<float>& model, AdamW& adam) override {
    Copy(model.Parameters(), model_->Parameters(), /*grads=*/false);
    Copy(model.Buffers(), model_->Buffers(), false);
    for (size_t i = 0; i < adam.tensors().size(); ++i) {
      adam_->first_moment(i) = adam.first_moment(i);
      adam_->second_moment(i) = adam.second_moment(i);
    }
    adam_->set_step(adam.step());
    return absl::OkStatus();
  }
  absl::Status StoreState(Model<float>& model, AdamW& adam) override {
    Copy(model_->Parameters(), model.Parameters(), false);
    Copy(model_->Buffers(), model.Buffers(), false);
    for (size_t i = 0; i < adam.tensors().size(); ++i) {
      adam.first_moment(i) = adam_->first_moment(i);
      adam.second_moment(i) = adam_->second_moment(i);
    }
    adam.set_step(adam_->step());
    return absl::OkStatus();
  }
  absl::Status ZeroGrad() override {
    model_->ZeroGrad();
    return absl::OkStatus();
  }
  absl::StatusOr<double> ForwardBackward(std::span<const int32_t> inputs,
                                         std::span<const int32_t> targets, int batch,
                                         std::span<const int32_t> segment_starts,
                                         float grad_scale) override {
    return model_->ForwardBackward(inputs, targets, batch, segment_starts, grad_scale);
  }
  absl::StatusOr<double> Evaluate(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                                  int batch, std::span<const int32_t> segment_starts) override {
    return model_->Evaluate(inputs, targets, batch, segment_starts);
  }
  const std::vector<std::vector<int64_t>>& expert_counts() const override {
    return model_->expert_counts();
  }
  double aux_loss() const override { return model_->aux_loss(); }
  absl::StatusOr<double> GradNorm(double) override {
    ADD_FAILURE() << "a job of several ranks measures the norm on the host";
    return 0.0;
  }
  absl::Status OptimizerStep(double lr) override {
    EXPECT_TRUE(loaded_) << "the reduced gradients must come back before the step";
    loaded_ = false;
    adam_->Step(lr, scale_);
    scale_ = 1.0;
    return absl::OkStatus();
  }
  absl::StatusOr<DeviceStepStats> StepStats() override { return DeviceStepStats{}; }
  std::vector<ExpertParallelGroup::Layer> ExpertParallelLayers(bool) override {
    std::vector<ExpertParallelGroup::Layer> layers;
    for (int b = 0; b < model_->config().blocks; ++b) {
      MoeLayer<float>* moe = &model_->moe(b);
      layers.push_back({moe->config(), std::make_unique<HostExpertInstances>(&moe->experts()),
                        [moe](std::unique_ptr<ExpertExecutor<float>> executor) {
                          moe->SetExecutor(std::move(executor));
                        }});
    }
    return layers;
  }
  absl::Status StoreGradients(Model<float>& model) override {
    ++host_crossings;
    Copy(model_->Parameters(), model.Parameters(), /*grads=*/true);
    return absl::OkStatus();
  }
  absl::Status LoadGradients(Model<float>& model) override {
    ++host_crossings;
    Copy(model.Parameters(), model_->Parameters(), true);
    loaded_ = true;
    return absl::OkStatus();
  }
  bool reduces_gradients_on_device() const override { return keeps_gradients_; }
  absl::StatusOr<std::span<float>> PackGradients(std::span<const size_t> tensors) override {
    EXPECT_TRUE(keeps_gradients_);
    const std::vector<ParamRef<float>> p = model_->Parameters();
    packed_.clear();
    for (const size_t i : tensors) packed_.insert(packed_.end(), p[i].grad, p[i].grad + p[i].size);
    return std::span<float>(packed_);
  }
  absl::Status UnpackGradients(std::span<const size_t> tensors) override {
    const std::vector<ParamRef<float>> p = model_->Parameters();
    size_t at = 0;
    for (const size_t i : tensors) {
      std::copy_n(packed_.data() + at, p[i].size, p[i].grad);
      at += static_cast<size_t>(p[i].size);
    }
    EXPECT_EQ(at, packed_.size());
    loaded_ = true;
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<double>> GradSquares() override {
    std::vector<double> squares;
    for (const ParamRef<float>& p : model_->Parameters()) {
      double sum = 0;
      for (int64_t j = 0; j < p.size; ++j) sum += static_cast<double>(p.grad[j]) * p.grad[j];
      squares.push_back(sum);
    }
    return squares;
  }
  absl::Status ScaleGradients(double scale) override {
    scale_ = scale;
    return absl::OkStatus();
  }

 private:
  HostCopyEngine() = default;
  static void Copy(const std::vector<ParamRef<float>>& from, const std::vector<ParamRef<float>>& to,
                   bool grads) {
    ASSERT_EQ(from.size(), to.size());
    for (size_t i = 0; i < from.size(); ++i) {
      ASSERT_EQ(from[i].size, to[i].size) << from[i].name;
      std::copy_n(grads ? from[i].grad : from[i].value, from[i].size,
                  grads ? to[i].grad : to[i].value);
    }
  }
  std::unique_ptr<Model<float>> model_;
  std::unique_ptr<AdamW> adam_;
  bool loaded_ = false;
  bool keeps_gradients_ = false;
  std::vector<float> packed_;  // PackGradients' buffer
  double scale_ = 1.0;         // ScaleGradients'
};

// The in-process channel, answering takes_device_buffers() (HostCopyEngine's "device" memory
// is host memory, which the in-process channel takes as it is); its sub-channels too.
class DeviceClaimingChannel final : public comm::ForwardingChannel {
 public:
  using ForwardingChannel::ForwardingChannel;
  bool takes_device_buffers() const override { return true; }
  absl::StatusOr<std::unique_ptr<comm::DataChannel>> Split(int color, int key) override {
    return SplitInto<DeviceClaimingChannel>(color, key);
  }
};

// Runs `spec` on `ranks` in-process ranks (resumed from `resume` when set), over channels that
// take device buffers when `claim_device`.
testing::RanksRun RunRanks(int ranks, const rackrun::v1::JobSpec& spec,
                           const TrainerOptions& options, const std::string& resume = "",
                           bool claim_device = false) {
  testing::ChannelWrapper claim;
  if (claim_device) {
    claim = [](comm::DataChannel& in_process) {
      return std::make_unique<DeviceClaimingChannel>(in_process);
    };
  }
  return testing::RunTrainerRanks(ranks, spec, options, claim, resume);
}

TEST(TrainerTest, TwoRanksThroughADeviceEngineGiveTheCpuEnginesLosses) {
  const auto run = [](const rackrun::v1::JobSpec& spec, const TrainerOptions& options,
                      const std::string& resume = "") {
    return RunRanks(2, spec, options, resume).losses;
  };
  // Clipping on (a small clip, so that it scales): the host clips what the engine applies.
  const std::vector<std::string> common = {"balancer.policy=ultraep", "training.grad_clip=0.05",
                                           "data.batch_size=4", "training.steps=6"};
  const fs::path dir = FreshDir("device_engine_ranks");
  std::vector<std::string> cuda = common;
  cuda.insert(cuda.end(), {"resources.device=cuda:0", "checkpoint.dir=" + dir.string(),
                           "checkpoint.interval=3"});
  TrainerOptions engine;
  engine.device_engine = HostCopyEngine::Factory(/*keeps_gradients=*/false);
  const std::vector<double> cpu = run(TinySpec(common), TrainerOptions());
  const std::vector<double> device = run(TinySpec(cuda), engine);
  ASSERT_EQ(cpu.size(), 6u);
  EXPECT_EQ(device, cpu);
  // The engine's state reached the checkpoint (StoreState on every rank): the CPU engine
  // resumes it at step 3 and continues the same trajectory.
  std::vector<std::string> resume = common;
  resume.push_back("checkpoint.dir=" + (dir / "cpu").string());
  const std::vector<double> rest =
      run(TinySpec(resume), TrainerOptions(), CheckpointPath(dir.string(), 3));
  EXPECT_EQ(rest, std::vector<double>(cpu.begin() + 3, cpu.end()));
}

// Ranks whose channels take device buffers reduce, measure and clip the gradients where the
// engine keeps them (PackGradients, GradSquares, ScaleGradients; never StoreGradients): 2 ranks
// in one domain, and 4 ranks in 2 domains (expert gradients reduced across the domains too).
// Without clipping the losses are the host-staged path's bit for bit; with it within 1e-6
// (the norm adds tensor by tensor, not element by element, so the clipping factor may differ
// in its last bit). An engine that keeps no gradients, or a channel that takes no device
// buffers, leaves them host-staged.
TEST(TrainerTest, RanksReduceGradientsWhereTheEngineKeepsThem) {
  TrainerOptions host, keeps;
  host.device_engine = HostCopyEngine::Factory(/*keeps_gradients=*/false);
  keeps.device_engine = HostCopyEngine::Factory(/*keeps_gradients=*/true);
  for (const int ranks : {2, 4}) {
    for (const char* clip : {"0", "0.05"}) {
      SCOPED_TRACE(absl::StrCat(ranks, " ranks, grad_clip ", clip));
      const rackrun::v1::JobSpec spec =
          TinySpec({"balancer.policy=ultraep", absl::StrCat("training.grad_clip=", clip),
                    "data.batch_size=4", "training.steps=4", "resources.device=cuda:0",
                    "parallelism.expert_parallel=2"});
      HostCopyEngine::host_crossings = 0;
      const auto [staged, staged_on_device] = RunRanks(ranks, spec, host, "", true);
      EXPECT_FALSE(staged_on_device);
      EXPECT_GT(HostCopyEngine::host_crossings, 0);
      HostCopyEngine::host_crossings = 0;
      const auto [kept, kept_on_device] = RunRanks(ranks, spec, keeps, "", true);
      EXPECT_TRUE(kept_on_device);
      EXPECT_EQ(HostCopyEngine::host_crossings, 0);
      ASSERT_EQ(staged.size(), 4u);
      ASSERT_EQ(kept.size(), 4u);
      if (std::string(clip) == "0") {
        EXPECT_EQ(kept, staged);
      } else {
        for (size_t i = 0; i < kept.size(); ++i) {
          EXPECT_NEAR(kept[i], staged[i], 1e-6 * std::fabs(staged[i])) << "step " << i + 1;
        }
      }
      // Over a channel that takes host buffers only, the same engine stages them.
      EXPECT_FALSE(RunRanks(ranks, spec, keeps).gradients_on_device);
    }
  }
}

TEST(TrainerTest, TokenFilesStillTrain) {
  const fs::path dir = FreshDir("token_file");
  std::vector<std::string> docs;
  for (int d = 0; d < 40; ++d) docs.push_back("document " + std::to_string(d) + " of the test.\n");
  ASSERT_TRUE(data::WriteTokenFile((dir / "t.tokens").string(),
                                   {.vocab = data::kByteVocab,
                                    .end_of_document = data::kByteEndOfDocument,
                                    .tokens = data::ByteTokenize(docs)})
                  .ok());
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(TinySpec(
      {"data.train=" + (dir / "t.tokens").string(), "data.validation=", "training.steps=2"}));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->spec().model().vocab(), 257);
  EXPECT_EQ((*t)->train_data().tokenizer().kind, "bytes");
  absl::StatusOr<TrainSummary> s = (*t)->Run();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->losses.size(), 2u);
}

// A blend (Megatron's --data-path form) resumes bit-identically: the checkpoint holds the
// stream position and each dataset's draws.
TEST(TrainerTest, ABlendResumesBitIdentically) {
  const fs::path dir = FreshDir("blend");
  const std::string blend = "data.blend=0.7," + (DataDir() / "brown").string() + ",0.3," +
                            (DataDir() / "brown-val").string();
  const rackrun::v1::JobSpec spec =
      TinySpec({"data.train=", blend, "data.batch_size=4", "training.steps=10",
                "checkpoint.dir=" + dir.string(), "checkpoint.interval=5"});
  const std::vector<double> full = Losses(spec);
  ASSERT_EQ(full.size(), 10u);
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(spec);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->train_data().datasets(), 2u);
  ASSERT_TRUE((*t)->Resume(CheckpointPath(dir.string(), 5)).ok());
  EXPECT_EQ((*t)->resume_note(), "");
  absl::StatusOr<TrainSummary> s = (*t)->Run();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->losses, std::vector<double>(full.begin() + 5, full.end()));
  // The other weights are other data: refused, both named.
  absl::StatusOr<std::unique_ptr<Trainer>> other =
      Trainer::Create(TinySpec({"data.train=",
                                "data.blend=0.5," + (DataDir() / "brown").string() + ",0.5," +
                                    (DataDir() / "brown-val").string(),
                                "data.batch_size=4"}));
  ASSERT_TRUE(other.ok());
  const absl::Status refused = (*other)->Resume(CheckpointPath(dir.string(), 5));
  EXPECT_THAT(refused.message(), HasSubstr("belongs to other data (0.7 x '"));
}

// A checkpoint trained on one tokenizer's data does not resume on another's, even when the
// model (and its vocabulary) is the same.
TEST(TrainerTest, ResumingOnAnotherTokenizersDataIsRefusedNamingBoth) {
  const fs::path dir = FreshDir("tokenizers");
  // A SentencePiece BPE model of 300 pieces, and the sample tokenized with it.
  std::vector<std::string> lines;
  {
    std::ifstream in(fs::path(RACKRUN_SOURCE_DIR) / "tests" / "data" / "brown-sample.txt");
    for (std::string l; std::getline(in, l);) {
      if (!l.empty() && l != "\f") lines.push_back(l);
    }
  }
  size_t next = 0;
  ASSERT_TRUE(data::TrainSentencePiece({.output = (dir / "m.model").string(),
                                        .vocab_size = 300,
                                        .model_type = "bpe",
                                        .threads = 1},
                                       [&](std::string* out) {
                                         if (next >= lines.size()) return false;
                                         *out = lines[next++];
                                         return true;
                                       })
                  .ok());
  const std::unique_ptr<data::Tokenizer> spm = *data::OpenTokenizer((dir / "m.model").string());
  ASSERT_TRUE(data::PrepareDataset(
                  (fs::path(RACKRUN_SOURCE_DIR) / "tests" / "data" / "brown-sample.txt").string(),
                  (dir / "spm").string(), "", {.tokenizer = spm.get()})
                  .ok());
  const std::string ckpt = (dir / "ckpt").string();
  ASSERT_EQ(
      Losses(TinySpec({"model.vocab=512", "training.steps=2", "checkpoint.dir=" + ckpt})).size(),
      2u);
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(
      TinySpec({"model.vocab=512", "data.train=" + (dir / "spm").string(), "data.validation="}));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->train_data().tokenizer().kind, "sentencepiece");
  const absl::Status s = (*t)->Resume(CheckpointPath(ckpt, 2));
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("was trained on data from tokenizer bytes (vocab 257) but "
                                     "this job's data is from sentencepiece bpe, vocab 300"));
  // And validation data from another tokenizer than the training data's is refused too.
  t = Trainer::Create(TinySpec({"model.vocab=512", "data.validation=" + (dir / "spm").string()}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("data.validation: made with tokenizer sentencepiece"));
}

// TrainingSession (training_session.h): the set-up both drivers share.
TEST(TrainingSessionTest, ARestartedAttemptContinuesItsOwnCheckpointsOnly) {
  const fs::path dir = FreshDir("session_owner");
  const rackrun::v1::JobSpec spec =
      TinySpec({"checkpoint.dir=" + dir.string(), "checkpoint.interval=4"});
  SessionOptions first;
  first.trainer.owner = "job j-1";
  first.resume_own_checkpoints = true;  // nothing there yet: starts at step 0
  absl::StatusOr<std::unique_ptr<TrainingSession>> s = TrainingSession::Start(spec, nullptr, first);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE((*s)->resumed_from().empty());
  EXPECT_EQ((*s)->trainer().step(), 0);
  ASSERT_TRUE((*s)->trainer().Run().ok());
  s->reset();

  // The same job's next attempt continues from its newest checkpoint (step 8).
  s = TrainingSession::Start(spec, nullptr, first);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->resumed_from(), dir.string());
  EXPECT_EQ((*s)->trainer().step(), 8);
  s->reset();

  // Another job's attempt is refused at the resume stage, naming the folder and its owner.
  SessionOptions other = first;
  other.trainer.owner = "job j-2";
  SessionStage stage = SessionStage::kCreate;
  s = TrainingSession::Start(spec, nullptr, other, &stage);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(stage, SessionStage::kResume);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("checkpoint.dir: '" + dir.string()));
  EXPECT_THAT(s.status().message(), HasSubstr("(owner: job j-1)"));

  // Without resume_own_checkpoints the folder is not resumed: Prepare refuses a folder
  // another run holds.
  other.resume_own_checkpoints = false;
  s = TrainingSession::Start(spec, nullptr, other, &stage);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(stage, SessionStage::kPrepare);
}

TEST(TrainingSessionTest, StartNamesTheStageThatFailed) {
  const fs::path dir = FreshDir("session_stages");
  SessionStage stage = SessionStage::kPrepare;
  absl::StatusOr<std::unique_ptr<TrainingSession>> s = TrainingSession::Start(
      TinySpec({"data.train=" + (dir / "missing.tokens").string()}), nullptr, {}, &stage);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(stage, SessionStage::kCreate);
  EXPECT_THAT(s.status().message(), HasSubstr("missing.tokens"));

  SessionOptions resume;
  resume.resume_from = (dir / "no-such-checkpoint").string();
  s = TrainingSession::Start(TinySpec(), nullptr, resume, &stage);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(stage, SessionStage::kResume);
  EXPECT_THAT(s.status().message(), HasSubstr("no-such-checkpoint"));

  std::ofstream(dir / "ckpt") << "not a folder";
  s = TrainingSession::Start(TinySpec({"checkpoint.dir=" + (dir / "ckpt").string()}), nullptr, {},
                             &stage);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(stage, SessionStage::kPrepare);
  EXPECT_THAT(s.status().message(), HasSubstr("checkpoint.dir: '" + (dir / "ckpt").string()));
}

}  // namespace
}  // namespace rackrun::runtime
