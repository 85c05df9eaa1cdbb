// The fixture of the end-to-end daemon tests (tests/daemons on loopback, tests/netns across
// network namespaces): a scratch folder with the Brown sample's tokens and the tiny job
// spec, a rackrun-coordinator, rackrun-worker processes (by hand with a torchrun-style
// RANK, or under mpirun) and the rackrun CLI, each run as a user runs them, plus the waits
// those tests share (workers idle, a job's state or step) and the direct `mpirun rackrun
// train` run that daemon jobs are compared with bit for bit.
//
// Where the processes run: by default on loopback (127.0.0.1). A test that runs them
// elsewhere sets coordinator_exec_/cli_exec_ (a command prefix such as `ip netns exec NS`)
// and coordinator_host_ before StartCoordinator, and starts workers with StartWorkerWith.
//
// Timeouts are short so faults surface in seconds: heartbeat every 200 ms, lost after 3 s,
// hung after 3 s, data-channel waits 30 s (longer than both, so the coordinator names the
// culprit before a victim's channel times out). These and every wait are quiet-machine
// figures multiplied by TimeScale() (tests/support/time_scale.h).
//
// The including test target defines RACKRUN_BINARY, RACKRUN_COORDINATOR_BINARY,
// RACKRUN_WORKER_BINARY, RACKRUN_SOURCE_DIR, MPIEXEC and MPIEXEC_NUMPROC_FLAG, and links
// nlohmann_json. Header-only.
#ifndef RACKRUN_TESTS_SUPPORT_DAEMON_FIXTURE_H_
#define RACKRUN_TESTS_SUPPORT_DAEMON_FIXTURE_H_

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/mpi_env.h"
#include "tests/support/process.h"
#include "tests/support/shell.h"
#include "tests/support/time_scale.h"

namespace rackrun::testing {

// The job of ep_train_test: 2 blocks, C=32, xhc N=4 k=2, 8 experts top-2.
inline constexpr char kDaemonJobSpec[] =
    "model: {width: 32, blocks: 2, heads: 2, seq_len: 32, residual: xhc, streams: 4, active: 2,\n"
    "        fixed: 1, moe: {experts: 8, top_k: 2, expert_hidden: 32}}\n"
    "data: {train: data/brown-sample, validation: data/brown-sample-val, batch_size: 8}\n"
    "training: {steps: 20, seed: 3, microbatches: 2, eval_interval: 10, eval_batches: 2}\n"
    "balancer: {policy: none, slots: 2}\n"
    "logging: {interval: 1}\n"
    "resources: {threads: 1, ranks: 2}\n";

// A numeric field of a proto message printed as JSON: int64 fields are strings there,
// int32 fields numbers, and zero values are left out.
inline int64_t Int(const nlohmann::json& j, const char* key) {
  if (!j.is_object() || !j.contains(key)) return 0;
  const nlohmann::json& v = j.at(key);
  if (v.is_string()) return std::stoll(v.get<std::string>());
  return v.is_number() ? v.get<int64_t>() : 0;
}

class DaemonFixture : public ::testing::Test {
 protected:
  using json = nlohmann::json;
  using Result = ShellResult;
  using Clock = std::chrono::steady_clock;

  explicit DaemonFixture(std::string prefix = "daemons_") : prefix_(std::move(prefix)) {}

  void SetUp() override {
    dir_ = ScratchDir(prefix_);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    const Result data = Shell(std::string(RACKRUN_BINARY) + " data --input " + RACKRUN_SOURCE_DIR +
                                  "/tests/data/brown-sample.txt --output " +
                                  (dir_ / "data").string() + " --val-fraction 0.1",
                              "data");
    ASSERT_EQ(data.code, 0) << data.err;
    std::ofstream(dir_ / "job.yaml") << kDaemonJobSpec;
  }

  void TearDown() override {
    StopDaemons();
    if (HasFailure()) {
      PrintLogTails(dir_);
    } else {
      std::filesystem::remove_all(dir_);
    }
  }

  // Workers first (killed), then mpirun and the coordinator (SIGTERM, then killed).
  void StopDaemons() {
    for (auto& w : workers_) w.reset();
    workers_.clear();
    if (mpirun_ != nullptr) {
      // SIGTERM: mpirun forwards it to the workers, which drain and exit (after a SIGKILL of
      // mpirun they would notice its death themselves: worker/launcher_watch.h).
      mpirun_->Signal(SIGTERM);
      mpirun_->Wait(std::chrono::seconds(20));
      mpirun_.reset();
    }
    if (coordinator_ != nullptr) {
      coordinator_->Signal(SIGTERM);
      coordinator_->Wait(std::chrono::seconds(10));
      coordinator_.reset();
    }
  }

  Result Shell(const std::string& command, const std::string& tag) {
    return ::rackrun::testing::Shell(command, dir_ / (tag + ".stdout"), dir_ / (tag + ".stderr"));
  }

  static std::string Ms(int64_t quiet_ms) { return std::to_string(ScaledMs(quiet_ms)); }

  // Starts (or restarts, on the same port and state) the coordinator on coordinator_host_
  // under coordinator_exec_; `extra` flags.
  void StartCoordinator(const std::vector<std::string>& extra = {}) {
    const std::filesystem::path banner =
        dir_ / ("coordinator" + std::to_string(starts_++) + ".log");
    std::vector<std::string> argv = coordinator_exec_;
    for (const std::string& a :
         {std::string(RACKRUN_COORDINATOR_BINARY), std::string("--listen"),
          coordinator_host_ + ":" + std::to_string(port_), std::string("--state-dir"),
          (dir_ / "state").string(), std::string("--heartbeat-interval-ms"), std::string("200"),
          std::string("--heartbeat-timeout-ms"), Ms(3000), std::string("--hang-timeout-ms"),
          Ms(3000), std::string("--reattach-grace-ms"), Ms(15000),
          std::string("--channel-timeout-ms"), Ms(30000)}) {
      argv.push_back(a);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    coordinator_ = std::make_unique<Child>(argv, banner);
    std::string text;
    const std::string host = std::regex_replace(coordinator_host_, std::regex("\\."), "\\.");
    std::smatch m = WaitForText(banner, std::regex("listening on " + host + ":([0-9]+)"), &text);
    ASSERT_FALSE(m.empty()) << "no banner: " << text;
    port_ = std::stoi(m[1].str());
    address_ = coordinator_host_ + ":" + m[1].str();
  }

  std::vector<std::string> WorkerEnv() const {
    return {"RACKRUN_COORDINATOR=" + address_,
            "RACKRUN_TOKEN_FILE=" + (dir_ / "state" / worker_token_).string(),
            "RACKRUN_VICTIM_GRACE_MS=" + Ms(4000)};
  }

  // A worker started by hand with a torchrun-style RANK, under `exec` (a command prefix,
  // empty for none), its data channel on `data_address`; `extra` flags, `extra_env`
  // variables.
  Child& StartWorkerWith(const std::vector<std::string>& exec, const std::string& data_address,
                         int launcher_rank, const std::vector<std::string>& extra = {},
                         const std::vector<std::string>& extra_env = {}) {
    std::vector<std::string> env = WorkerEnv();
    env.push_back("RANK=" + std::to_string(launcher_rank));
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    std::vector<std::string> argv = exec;
    for (const std::string& a : {std::string(RACKRUN_WORKER_BINARY), std::string("--data-address"),
                                 data_address, std::string("--threads"), std::string("1")}) {
      argv.push_back(a);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    workers_.push_back(std::make_unique<Child>(
        argv, dir_ / ("worker" + std::to_string(workers_.size()) + ".log"), env));
    return *workers_.back();
  }

  // The same on loopback.
  Child& StartWorker(int launcher_rank, const std::vector<std::string>& extra = {},
                     const std::vector<std::string>& extra_env = {}) {
    return StartWorkerWith({}, "127.0.0.1", launcher_rank, extra, extra_env);
  }

  // `mpirun -np N rackrun-worker`: the launcher ranks decide the job ranks.
  void StartMpirunWorkers(int n) {
    const std::filesystem::path session = dir_ / "session";
    std::filesystem::create_directories(session);
    std::vector<std::string> argv = {"/usr/bin/env"};
    for (const std::string& e : Words(std::string(kMpiEnv))) argv.push_back(e);
    argv.push_back("OMPI_MCA_orte_tmpdir_base=" + session.string());
    for (const std::string& e : WorkerEnv()) argv.push_back(e);
    for (const char* a :
         {MPIEXEC, "--allow-run-as-root", "--oversubscribe", MPIEXEC_NUMPROC_FLAG}) {
      argv.push_back(a);
    }
    argv.push_back(std::to_string(n));
    for (const char* a : {RACKRUN_WORKER_BINARY, "--data-address", "127.0.0.1", "--threads", "1"}) {
      argv.push_back(a);
    }
    mpirun_ = std::make_unique<Child>(argv, dir_ / "mpirun.log");
  }

  static std::vector<std::string> Words(const std::string& s) {
    std::vector<std::string> out;
    std::istringstream in(s);
    for (std::string w; in >> w;) out.push_back(w);
    return out;
  }

  // The rackrun CLI with `args`, under cli_exec_, with cli_token_.
  Result Cli(const std::string& args, const std::string& tag = "cli") {
    return Shell("cd " + dir_.string() + " && env -u RACKRUN_TOKEN RACKRUN_COORDINATOR=" +
                     address_ + " RACKRUN_TOKEN_FILE=" + (dir_ / "state" / cli_token_).string() +
                     " timeout -k 5 120 " + cli_exec_ + RACKRUN_BINARY + " " + args,
                 tag);
  }

  json Json(const std::string& args) {
    const Result r = Cli(args + " --json", "json");
    EXPECT_EQ(r.code, 0) << r.err;
    json j = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << r.out;
    return j;
  }

  // Waits until `n` workers are IDLE.
  void WaitIdle(int n) {
    const auto end = Clock::now() + Scaled(std::chrono::seconds(30));
    int idle = 0;
    while (Clock::now() < end) {
      idle = 0;
      for (const json& w : Json("workers").value("workers", json::array())) {
        if (w.value("state", "") == "IDLE") ++idle;
      }
      if (idle >= n) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    FAIL() << "only " << idle << " of " << n << " workers became idle";
  }

  std::string Submit(const std::string& sets, const std::string& tag = "submit") {
    const Result r = Cli("submit job.yaml " + sets, tag);
    EXPECT_EQ(r.code, 0) << r.err;
    return r.out.substr(0, r.out.find('\n'));
  }

  // Waits for the job to reach `state` (or any terminal state); its last Get. `timeout` is
  // a quiet machine's, scaled.
  json WaitState(const std::string& id, const std::string& state,
                 std::chrono::seconds timeout = std::chrono::seconds(90)) {
    const auto end = Clock::now() + Scaled(timeout);
    json job;
    while (Clock::now() < end) {
      job = Json("status " + id);
      const std::string s = job.value("state", "");
      if (s == state || s == "SUCCEEDED" || s == "FAILED" || s == "CANCELLED") return job;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return job;
  }

  // Waits for the job to fail with a first failure whose message has `text`: a rank's own
  // report can replace a timeout verdict after the job failed (Jobs::RankResult), so this
  // waits past FAILED for the grace. Its last Get.
  json WaitFirstFailure(const std::string& id, const std::string& text) {
    json job = WaitState(id, "FAILED");
    const auto end = Clock::now() + Scaled(std::chrono::seconds(30));
    while (job.value("state", "") == "FAILED" && Clock::now() < end &&
           job.value("first_failure", json::object()).value("message", "").find(text) ==
               std::string::npos) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      job = Json("status " + id);
    }
    return job;
  }

  // Waits until the job's rank 0 reported at least `step`.
  void WaitStep(const std::string& id, int64_t step) {
    const auto end = Clock::now() + Scaled(std::chrono::seconds(60));
    while (Clock::now() < end) {
      const json job = Json("status " + id);
      if (Int(job.value("last_progress", json::object()), "step") >= step) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "job " << id << " never reached step " << step;
  }

  // The "loss"/"val_loss" texts of a JSON Lines log as written (%.9g): compared bit for bit.
  static std::vector<std::string> Losses(const std::filesystem::path& log) {
    std::vector<std::string> out;
    const std::regex loss("\"(loss|val_loss)\": ([^,}]+)");
    for (const std::string& line : Lines(log)) {
      for (auto it = std::sregex_iterator(line.begin(), line.end(), loss);
           it != std::sregex_iterator(); ++it) {
        out.push_back((*it)[1].str() + "=" + (*it)[2].str());
      }
    }
    return out;
  }

  // `mpirun -np R rackrun train job.yaml SETS --log-json LOG` on this machine: the direct
  // launch.
  Result Mpirun(int ranks, const std::string& sets, const std::filesystem::path& log) {
    const std::filesystem::path session = dir_ / "session-train";
    std::filesystem::create_directories(session);
    return Shell("cd " + dir_.string() + " && env " + kMpiEnv +
                     " OMPI_MCA_orte_tmpdir_base=" + session.string() + " timeout -k 10 300 " +
                     MPIEXEC + " --allow-run-as-root --oversubscribe " + MPIEXEC_NUMPROC_FLAG +
                     " " + std::to_string(ranks) + " " + RACKRUN_BINARY + " train job.yaml " +
                     sets + " --log-json " + log.string(),
                 "mpirun-train");
  }

  std::string prefix_;
  std::filesystem::path dir_;
  // The files of the state folder the workers and the CLI take their token from.
  std::string worker_token_ = "token";
  std::string cli_token_ = "token";
  // Where the coordinator listens and what its command and the CLI's are prefixed with.
  std::string coordinator_host_ = "127.0.0.1";
  std::vector<std::string> coordinator_exec_;
  std::string cli_exec_;
  int port_ = 0;
  int starts_ = 0;
  std::string address_;
  std::unique_ptr<Child> coordinator_;
  std::unique_ptr<Child> mpirun_;
  std::vector<std::unique_ptr<Child>> workers_;
};

}  // namespace rackrun::testing

#endif  // RACKRUN_TESTS_SUPPORT_DAEMON_FIXTURE_H_
