// The daemons and GPUs on a machine without one (issue 35 item 5), as processes on loopback
// (tests/support/daemon_fixture.h): a worker started with --device cuda:0 refuses to start
// naming the flag and the cause; a job with resources.device: cuda submitted to CPU-only
// workers is not placed and its status and `rackrun watch` say why, naming resources.device;
// `rackrun workers` shows "-" in its GPU column for CPU workers and its columns are still
// found by where their headers start (tools/slurm-check's reading). The same daemons on a
// GPU: gpu_daemons_test.cc (label gpu).

#include <chrono>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/cuda/device_probe.h"
#include "tests/support/daemon_fixture.h"
#include "tests/support/shell.h"
#include "tests/support/time_scale.h"

namespace {

using nlohmann::json;
using ::rackrun::testing::Scaled;
using ::testing::HasSubstr;
using Result = ::rackrun::testing::ShellResult;
using Clock = std::chrono::steady_clock;

// The cell under `header` in `line`, located as tools/slurm-check does: the column starts
// where the header's name starts in the header line; the cell is the first word there.
std::string CellUnder(const std::string& header_line, const std::string& header,
                      const std::string& line) {
  const size_t at = header_line.find(" " + header + " ");
  if (at == std::string::npos || at + 1 >= line.size()) return "";
  const size_t start = line.find_first_not_of(' ', at + 1);
  if (start == std::string::npos) return "";
  return line.substr(start, line.find(' ', start) - start);
}

class DeviceTest : public ::rackrun::testing::DaemonFixture {
 protected:
  DeviceTest() : DaemonFixture("daemons_device_") {}

  // A machine with a usable GPU cannot show the refusals tested here.
  void SetUp() override {
    DaemonFixture::SetUp();
    if (rackrun::runtime::cuda::VisibleGpus().ok()) {
      GTEST_SKIP() << "this machine has a GPU: the CPU-only behaviour is not observable here "
                      "(gpu_daemons_test covers the GPU)";
    }
  }
};

// --device cuda:0 (and plain cuda) without a GPU: the worker exits 1 before it registers,
// with one line naming --device and the probe's cause; a malformed --device is named too.
TEST_F(DeviceTest, AWorkerWithAGpuDeviceRefusesToStartWithoutOne) {
  StartCoordinator();
  for (const std::string device : {"cuda:0", "cuda"}) {
    rackrun::testing::Child& w = StartWorker(0, {"--device", device});
    EXPECT_EQ(w.Wait(Scaled(std::chrono::seconds(20))), 1) << device;
    const std::string log =
        rackrun::testing::Slurp(dir_ / ("worker" + std::to_string(workers_.size() - 1) + ".log"));
    // A build without the GPU engine (the sanitizer builds) says that instead.
    EXPECT_THAT(log, ::testing::ContainsRegex("rackrun-worker: --device " + device +
                                              ": (no CUDA device|this build has no GPU engine)"))
        << log;
    EXPECT_THAT(log, HasSubstr("--device cpu")) << log;  // what to do instead
    EXPECT_THAT(log, ::testing::Not(HasSubstr("resources.device"))) << log;
  }
  rackrun::testing::Child& bad = StartWorker(0, {"--device", "gpu0"});
  EXPECT_EQ(bad.Wait(Scaled(std::chrono::seconds(20))), 1);
  const std::string log = rackrun::testing::Slurp(dir_ / "worker2.log");
  EXPECT_THAT(log, HasSubstr("--device gpu0: ")) << log;
  // None of them registered.
  EXPECT_TRUE(Json("workers --all").value("workers", json::array()).empty());
}

// Two CPU workers: a cuda job is not placed, says why (its message, an event `rackrun watch`
// prints), and holds the FIFO queue; cancelled, the cpu job behind it runs on the same
// workers. The workers table shows "-" under GPU, and STATE found by its header reads IDLE.
TEST_F(DeviceTest, ACudaJobOnCpuWorkersIsNotPlacedAndSaysWhy) {
  StartCoordinator();
  StartWorker(0);
  StartWorker(1);
  WaitIdle(2);

  const Result table = Cli("workers", "workers-table");
  ASSERT_EQ(table.code, 0) << table.err;
  std::vector<std::string> lines;
  std::istringstream in(table.out);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  ASSERT_EQ(lines.size(), 3u) << table.out;
  EXPECT_THAT(lines[0], HasSubstr(" DEVICE ")) << table.out;
  EXPECT_THAT(lines[0], HasSubstr(" GPU ")) << table.out;
  std::set<std::string> lranks;
  for (size_t i = 1; i < lines.size(); ++i) {
    EXPECT_EQ(CellUnder(lines[0], "DEVICE", lines[i]), "cpu") << table.out;
    EXPECT_EQ(CellUnder(lines[0], "GPU", lines[i]), "-") << table.out;
    EXPECT_EQ(CellUnder(lines[0], "STATE", lines[i]), "IDLE") << table.out;
    lranks.insert(CellUnder(lines[0], "LRANK", lines[i]));
  }
  EXPECT_EQ(lranks, (std::set<std::string>{"0", "1"})) << table.out;
  for (const json& w : Json("workers").value("workers", json::array())) {
    EXPECT_FALSE(w.contains("gpu")) << w.dump();
  }

  const std::string gpu_job = Submit("--set resources.ranks=1 --set resources.device=cuda", "gpu");
  const std::string cpu_job = Submit("--set resources.ranks=1 --set training.steps=2", "cpu");
  const std::string why =
      "not placed: resources.device: cuda needs 1 idle worker with a GPU offering channel ucx; "
      "idle now: 2 workers, none with a GPU";
  json job;
  for (const auto end = Clock::now() + Scaled(std::chrono::seconds(30)); Clock::now() < end;) {
    job = Json("status " + gpu_job);
    if (job.value("message", "").find(why) != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(job.value("state", ""), "QUEUED") << job.dump();
  EXPECT_THAT(job.value("message", ""), HasSubstr(why)) << job.dump();
  EXPECT_EQ(Json("status " + cpu_job).value("state", ""), "QUEUED") << "FIFO: it waits behind";
  const Result status = Cli("status " + gpu_job, "status-gpu");
  EXPECT_THAT(status.out, HasSubstr(why)) << status.out;
  std::this_thread::sleep_for(Scaled(std::chrono::seconds(1)));  // more ticks ask again

  ASSERT_EQ(Cli("cancel " + gpu_job, "cancel").code, 0);
  job = WaitState(cpu_job, "SUCCEEDED");
  EXPECT_EQ(job.value("state", ""), "SUCCEEDED") << job.dump();
  // `rackrun watch` replays the cancelled job's events: the reason, said once although the
  // scheduler asked on every tick.
  const Result watch = Cli("watch " + gpu_job + " --plain", "watch-gpu");
  size_t said = 0;
  for (size_t at = watch.out.find(why); at != std::string::npos; at = watch.out.find(why, at + 1))
    ++said;
  EXPECT_EQ(said, 1u) << watch.out << watch.err;
}

}  // namespace
