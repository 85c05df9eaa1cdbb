// The daemons on a GPU (issue 35 item 5; label gpu, run by tools/gpu-check on a lent GPU
// machine; not run on a GPU yet): a coordinator, one worker started with --device cuda:0
// and --metrics-listen, and the CLI, as processes on loopback. `rackrun workers` shows the
// GPU (its name and memory, as the device probe reads them), a small cuda job (the daemon
// tests' spec at one rank, 10 steps, naming cuda:7: the worker's --device wins) succeeds
// with finite losses, and the worker's rackrun_gpu_* series hold the engine's figures
// (memory in use non-zero, the step's device time). Two workers sharing cuda:0 run a 2-rank
// expert-parallel cuda job over UCX like the CPU. Without a GPU it skips, naming the cause.
// The CPU-only side: device_test.cc.
//
// Where the programs and sources are: tools/gpu-check --bundle packs rackrun,
// rackrun-coordinator and rackrun-worker beside this binary and runs it from the source
// tree of another machine, so the paths compiled in (the build's) are the fallback only.

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <regex>
#include <string>
#include <system_error>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/cuda/device_probe.h"

namespace gpu_daemons {

namespace fs = std::filesystem;

// `name` beside this test binary (a bundle), else `built` (the build tree).
inline const char* Program(const char* name, const char* built) {
  static std::map<std::string, std::string>* const paths = new std::map<std::string, std::string>;
  auto [it, inserted] = paths->try_emplace(name);
  if (inserted) {
    std::error_code ec;
    const fs::path beside = fs::read_symlink("/proc/self/exe", ec).parent_path() / name;
    it->second = !ec && fs::exists(beside, ec) ? beside.string() : std::string(built);
  }
  return it->second.c_str();
}

// The source tree: the build's, else the working folder (tools/gpu-check runs from the root
// of the tree it was carried in).
inline const char* SourceDir() {
  static const std::string* const dir = [] {
    std::error_code ec;
    const fs::path sample = "tests/data/brown-sample.txt";
    if (fs::exists(fs::path(RACKRUN_BUILT_SOURCE_DIR) / sample, ec)) {
      return new std::string(RACKRUN_BUILT_SOURCE_DIR);
    }
    return new std::string(fs::current_path(ec).string());
  }();
  return dir->c_str();
}

}  // namespace gpu_daemons

#define RACKRUN_BINARY ::gpu_daemons::Program("rackrun", RACKRUN_BUILT_BINARY)
#define RACKRUN_COORDINATOR_BINARY \
  ::gpu_daemons::Program("rackrun-coordinator", RACKRUN_BUILT_COORDINATOR_BINARY)
#define RACKRUN_WORKER_BINARY ::gpu_daemons::Program("rackrun-worker", RACKRUN_BUILT_WORKER_BINARY)
#define RACKRUN_SOURCE_DIR ::gpu_daemons::SourceDir()

#include "metrics/series_checks.h"
#include "tests/support/daemon_fixture.h"

namespace {

using nlohmann::json;
using ::rackrun::testing::Scaled;
using ::testing::HasSubstr;
using Result = ::rackrun::testing::ShellResult;

class GpuDaemonsTest : public ::rackrun::testing::DaemonFixture {
 protected:
  GpuDaemonsTest() : DaemonFixture("gpu_daemons_") {}

  void SetUp() override {
    absl::StatusOr<std::vector<rackrun::runtime::cuda::GpuInfo>> gpus =
        rackrun::runtime::cuda::VisibleGpus();
    if (!gpus.ok()) GTEST_SKIP() << gpus.status().message();
    gpu_ = gpus->front();
    DaemonFixture::SetUp();
  }

  rackrun::runtime::cuda::GpuInfo gpu_;
};

TEST_F(GpuDaemonsTest, AWorkerOnCuda0RunsACudaJobAndExportsGpuMemory) {
  StartCoordinator();
  rackrun::testing::Child& worker =
      StartWorker(0, {"--device", "cuda:0", "--metrics-listen", "127.0.0.1:0"});
  std::string text;
  const std::smatch port = rackrun::testing::WaitForText(
      dir_ / "worker0.log", std::regex("metrics on http://127\\.0\\.0\\.1:([0-9]+)/metrics"), &text,
      Scaled(std::chrono::seconds(60)));
  ASSERT_FALSE(port.empty()) << text;
  WaitIdle(1);
  ASSERT_EQ(worker.Wait(std::chrono::milliseconds(0)), -2) << "the worker exited";

  // The registration carried the GPU; the table shows it.
  const json workers = Json("workers").value("workers", json::array());
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ(workers[0].value("device", ""), "cuda:0") << workers.dump();
  EXPECT_EQ(workers[0]["gpu"].value("name", ""), gpu_.name) << workers.dump();
  EXPECT_EQ(rackrun::testing::Int(workers[0]["gpu"], "total_bytes"), gpu_.total_bytes);
  EXPECT_EQ(workers[0]["gpu"].value("compute_major", 0), gpu_.major);
  const Result table = Cli("workers", "workers-table");
  EXPECT_THAT(table.out, HasSubstr(" GPU ")) << table.out;
  EXPECT_THAT(table.out, HasSubstr(gpu_.name + " (")) << table.out;
  EXPECT_THAT(table.out, HasSubstr(" GiB)")) << table.out;

  // The spec names cuda:7 (no such GPU on a lent machine): the worker runs it on its own
  // --device cuda:0.
  const std::filesystem::path log = dir_ / "gpu.jsonl";
  const Result watch =
      Cli("submit job.yaml --set resources.ranks=1 --set resources.device=cuda:7 "
          "--set training.steps=10 --set logging.json=" +
              log.string() + " --watch --plain",
          "watch");
  EXPECT_EQ(watch.code, 0) << watch.out << watch.err;
  EXPECT_THAT(watch.out, HasSubstr("SUCCEEDED")) << watch.out;
  const std::vector<std::string> losses = Losses(log);
  int finite = 0;
  for (const std::string& l : losses) {
    if (l.rfind("loss=", 0) != 0) continue;
    const double v = std::stod(l.substr(5));
    EXPECT_TRUE(std::isfinite(v)) << l;
    ++finite;
  }
  EXPECT_EQ(finite, 10) << "one training loss per step";
  EXPECT_THAT(rackrun::testing::Slurp(dir_ / "worker0.log"), HasSubstr("device cuda:0: "));

  // The last job's series stay until the next job starts.
  std::map<std::string, rackrun::metrics::MetricFamily> got =
      rackrun::metrics::ScrapeMetrics(std::stoi(port[1].str()));
  ASSERT_FALSE(got["rackrun_gpu_memory_in_use_bytes"].samples.empty());
  EXPECT_GT(got["rackrun_gpu_memory_in_use_bytes"].samples[0].value, 0);
  EXPECT_GE(got["rackrun_gpu_memory_peak_bytes"].samples.at(0).value,
            got["rackrun_gpu_memory_in_use_bytes"].samples[0].value);
  EXPECT_GE(got["rackrun_gpu_memory_reserved_bytes"].samples.at(0).value,
            got["rackrun_gpu_memory_in_use_bytes"].samples[0].value);
  EXPECT_EQ(got["rackrun_gpu_memory_total_bytes"].samples.at(0).value,
            static_cast<double>(gpu_.total_bytes));
  double device_s = 0;
  for (const auto& s : got["rackrun_gpu_step_device_seconds"].samples) device_s += s.value;
  EXPECT_GT(device_s, 0) << "the last step's device time";
}

// Expert parallelism on GPUs through the daemons (issue 35 item 6): two workers started with
// --device cuda:0 share the one GPU; a 2-rank cuda job (ultraep: replicas fanned out, replica
// gradients reduced) runs expert-parallel over the daemons' data channel (UCX), host-staged,
// and follows the same job on the CPU (on the same workers) within the fp32 bound, step by step.
TEST_F(GpuDaemonsTest, TwoWorkersSharingCuda0RunAnExpertParallelJobLikeTheCpu) {
  StartCoordinator();
  StartWorker(0, {"--device", "cuda:0"});
  StartWorker(1, {"--device", "cuda:0"});
  WaitIdle(2);
  const auto losses = [&](const std::string& device) {
    const std::filesystem::path log = dir_ / ("ep-" + device + ".jsonl");
    const Result watch =
        Cli("submit job.yaml --set resources.ranks=2 --set resources.device=" + device +
                " --set balancer.policy=ultraep --set training.steps=10 --set logging.json=" +
                log.string() + " --watch --plain",
            "watch-" + device);
    EXPECT_EQ(watch.code, 0) << watch.out << watch.err;
    EXPECT_THAT(watch.out, HasSubstr("SUCCEEDED")) << watch.out;
    std::vector<double> out;
    for (const std::string& l : Losses(log)) {
      if (l.rfind("loss=", 0) == 0) out.push_back(std::stod(l.substr(5)));
    }
    return out;
  };
  const std::vector<double> cpu = losses("cpu");
  ASSERT_EQ(cpu.size(), 10u) << "one training loss per step";
  const std::vector<double> gpu = losses("cuda:0");
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_NEAR(gpu[i], cpu[i], 1e-4 * std::fabs(cpu[i])) << "step " << i + 1;
  }
}

}  // namespace
