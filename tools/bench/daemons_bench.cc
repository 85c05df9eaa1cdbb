// Daemon benchmarks (issue 9, section 9): the coordinator and worker control plane against
// a real `rackrun-coordinator` child process on 127.0.0.1 with a scratch --state-dir, from
// clients that are threads of this process. Four parts, each bounded in time:
//
//   plan       Per-(microbatch, layer) plan round trip on R ranks (threads of this
//              process), both modes, same loads, same defaulted spec:
//                inband      runtime::InBandPlanSource::Solve over a Gloo channel
//                            (InMemoryRendezvousStore, 127.0.0.1): allgather + solve;
//                coordinator worker::CoordinatorPlanSource::Solve against the child
//                            coordinator (a job submitted with balancer.mode coordinator,
//                            R fake workers registered over RackControl so its attempt is
//                            RUNNING): row up the Plans stream, plan back.
//              Each rank times its own Solve calls; p50/p99 pool all ranks' samples. Also,
//              in the same run: the planner's Solve alone on this thread (what both modes
//              pay once), and bare unary ping-pongs (RackControl.Heartbeat and
//              grpc.health.v1.Health/Check) on the same coordinator. Rank 0's plan
//              fingerprints of both modes are compared solve by solve.
//   submit     N sequential JobService.Submit calls with fresh request ids (each is one
//              SQLite commit with synchronous=FULL, i.e. an fsync, on the state dir).
//   heartbeat  W registered workers heartbeating from T client threads (one connection
//              each) for S seconds, open loop every I ms and then closed loop; handled
//              heartbeats/s, call latency, and the coordinator process's CPU
//              (/proc/<pid>/stat utime+stime over the window, % of one core).
//   watch      K Watch streams on one job while a fake 1-rank worker reports progress every
//              P ms for S seconds; delivery latency (Report sent -> event read on a stream,
//              same process, monotonic clock; it includes the event's SQLite commit), the
//              same from the Report's return (the fan-out alone), and whether every stream
//              got every event exactly once, in order.
//
//   bench_daemons_bench [--json] [--only plan,submit,heartbeat,watch] [--coordinator PATH]
//       [--scratch DIR] [--ranks 2,4] [--policy ultraep,none] [--experts 64] [--solves N]
//       [--pings N] [--submits N] [--workers 256] [--client-threads 8]
//       [--heartbeat-interval-ms 100] [--heartbeat-seconds 10] [--watchers 100]
//       [--progress-every-ms 5] [--watch-seconds 3]
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/signals.h"
#include "base/statistics.h"
#include "comm/gloo_channel.h"
#include "comm/rendezvous_store.h"
#include "jobspec/balancer.h"
#include "nlohmann/json.hpp"
#include "planner/generate.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "rackrun/v1/job_service.grpc.pb.h"
#include "rackrun/v1/rack_control.grpc.pb.h"
#include "rpc/channel.h"
#include "rpc/health_check.h"
#include "runtime/plan_source.h"
#include "tools/bench/startup.h"
#include "worker/connection.h"
#include "worker/coordinator_plan_source.h"

#ifndef RACKRUN_COORDINATOR_BINARY
#define RACKRUN_COORDINATOR_BINARY "rackrun-coordinator"
#endif

namespace {

using namespace std::chrono_literals;
using nlohmann::json;
using rackrun::base::MonotonicClock;
using rackrun::base::NowSeconds;
using rackrun::base::Percentile;
using rackrun::base::Stopwatch;

struct Flags {
  std::vector<std::string> only = {"plan", "submit", "heartbeat", "watch"};
  std::string coordinator = RACKRUN_COORDINATOR_BINARY;
  std::string scratch = std::filesystem::temp_directory_path().string();
  std::vector<int> ranks = {2, 4};
  std::vector<std::string> policies = {"ultraep", "none"};
  int experts = 64;
  int solves = 500;
  int pings = 2000;
  int submits = 200;
  int workers = 256;
  int client_threads = 8;
  int heartbeat_interval_ms = 100;
  double heartbeat_seconds = 10;
  int watchers = 100;
  int progress_every_ms = 5;
  double watch_seconds = 3;
};

// The running coordinator child, so that Die does not leave it behind.
std::atomic<pid_t> live_coordinator{-1};

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "bench_daemons_bench: %s\n", message.c_str());
  if (const pid_t pid = live_coordinator.load(); pid > 0) kill(pid, SIGKILL);
  std::exit(1);
}

// p50/p99/max of samples in seconds, as microseconds.
json Micros(const std::vector<double>& seconds) {
  return json{{"n", seconds.size()},
              {"p50_us", Percentile(seconds, 0.5) * 1e6},
              {"p99_us", Percentile(seconds, 0.99) * 1e6},
              {"max_us", Percentile(seconds, 1.0) * 1e6}};
}

// The filesystem type of the mount holding `path` (longest matching mount point).
std::string FilesystemOf(const std::string& path) {
  std::ifstream mounts("/proc/mounts");
  std::string device, point, type, rest, best_type = "?";
  size_t best = 0;
  while (mounts >> device >> point >> type && std::getline(mounts, rest)) {
    if (path.rfind(point, 0) == 0 && point.size() >= best) {
      best = point.size();
      best_type = type;
    }
  }
  return best_type;
}

// ---- The coordinator child process ----

class CoordinatorProcess {
 public:
  CoordinatorProcess(const Flags& flags, const std::string& name, std::vector<std::string> extra) {
    std::string tmpl = flags.scratch + "/rackrun-bench-" + name + "-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr)
      Die("cannot create a scratch folder under " + flags.scratch);
    dir_ = tmpl;
    std::vector<std::string> args = {flags.coordinator, "--listen", "127.0.0.1:0", "--state-dir",
                                     dir_ + "/state"};
    for (auto& e : extra) args.push_back(std::move(e));
    int out[2];
    if (pipe(out) != 0) Die("pipe failed");
    const std::string log = dir_ + "/coordinator.log";
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], 1);
      close(out[0]);
      if (FILE* err = std::fopen(log.c_str(), "w"); err != nullptr) dup2(fileno(err), 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    live_coordinator = pid_;
    out_ = fdopen(out[0], "r");
    char line[1024];
    if (out_ == nullptr || std::fgets(line, sizeof(line), out_) == nullptr) {
      Die("the coordinator (" + flags.coordinator + ") printed no banner; see " + log);
    }
    // main.cc prints the banner once the server reports SERVING.
    const std::string banner = line;
    const size_t at = banner.find("127.0.0.1:");
    if (at == std::string::npos) Die("unexpected coordinator banner: " + banner);
    address_ = "127.0.0.1:" + std::to_string(std::atoi(banner.c_str() + at + 10));
    // Keep reading its stdout so a chatty coordinator never blocks on a full pipe.
    drain_ = std::thread([f = out_] {
      char buf[1024];
      while (std::fgets(buf, sizeof(buf), f) != nullptr) {
      }
    });
    std::ifstream in(dir_ + "/state/token");
    in >> token_;
    if (token_.empty()) Die("no token in " + dir_ + "/state/token");
  }
  ~CoordinatorProcess() {
    live_coordinator = -1;
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      const auto end = MonotonicClock::now() + 10s;
      int status = 0;
      while (waitpid(pid_, &status, WNOHANG) != pid_) {
        if (MonotonicClock::now() > end) {
          kill(pid_, SIGKILL);
          waitpid(pid_, &status, 0);
          break;
        }
        std::this_thread::sleep_for(10ms);
      }
    }
    if (drain_.joinable()) drain_.join();
    if (out_ != nullptr) std::fclose(out_);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  const std::string& address() const { return address_; }
  const std::string& token() const { return token_; }
  std::string token_file() const { return dir_ + "/state/token"; }
  std::string state_dir() const { return dir_ + "/state"; }
  pid_t pid() const { return pid_; }

  // utime + stime of the process so far, in seconds.
  double CpuSeconds() const {
    std::ifstream in("/proc/" + std::to_string(pid_) + "/stat");
    std::string text;
    std::getline(in, text);  // one line
    // Fields after the command name (which is in parentheses and may hold spaces).
    const size_t paren = text.rfind(')');
    if (paren == std::string::npos) return 0;
    std::istringstream rest(text.substr(paren + 2));
    std::string field;
    double utime = 0, stime = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i) {
      if (i == 14) utime = std::atof(field.c_str());
      if (i == 15) stime = std::atof(field.c_str());
    }
    return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
  }

 private:
  std::string dir_;
  std::string address_;
  std::string token_;
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  std::thread drain_;
};

// A client of both services, on the channel every client uses. `connection` > 0 gives the
// channel its own TCP connection.
class Client {
 public:
  Client(const std::string& address, std::string token, int connection = 0)
      : token_(std::move(token)) {
    rackrun::rpc::CoordinatorChannelOptions options;
    options.connection_id = connection;
    channel_ =
        rackrun::rpc::CoordinatorChannel(address, grpc::InsecureChannelCredentials(), options);
    jobs_ = rackrun::v1::JobService::NewStub(channel_);
    rack_ = rackrun::v1::RackControl::NewStub(channel_);
  }
  std::unique_ptr<grpc::ClientContext> Ctx(std::chrono::milliseconds deadline = 10s) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + deadline);
    ctx->AddMetadata("authorization", "Bearer " + token_);
    return ctx;
  }
  rackrun::v1::JobService::Stub& jobs() { return *jobs_; }
  rackrun::v1::RackControl::Stub& rack() { return *rack_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

  std::string Register(const std::string& host, int launcher_rank) {
    rackrun::v1::RegisterRequest req;
    req.set_host(host);
    req.set_pid(10000 + launcher_rank);
    req.set_launcher_rank(launcher_rank);
    req.set_device("cpu");
    req.add_channels("ucx");
    req.add_channels("gloo");
    req.set_data_address("127.0.0.1");
    rackrun::v1::RegisterResponse resp;
    grpc::Status s = rack().Register(Ctx().get(), req, &resp);
    if (!s.ok()) Die("Register: " + s.error_message());
    return resp.worker_id();
  }
  void Deregister(const std::string& worker_id) {
    rackrun::v1::DeregisterRequest req;
    req.set_worker_id(worker_id);
    req.set_reason("benchmark done");
    rackrun::v1::DeregisterResponse resp;
    (void)rack().Deregister(Ctx().get(), req, &resp);
  }
  rackrun::v1::Job Get(const std::string& id) {
    rackrun::v1::GetJobRequest req;
    req.set_job_id(id);
    rackrun::v1::Job job;
    (void)jobs().Get(Ctx().get(), req, &job);
    return job;
  }
  // Polls Get until the job is in `state` (20 s at most); false otherwise.
  bool WaitState(const std::string& id, rackrun::v1::JobState state) {
    const auto end = MonotonicClock::now() + 20s;
    while (MonotonicClock::now() < end) {
      if (Get(id).state() == state) return true;
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }

 private:
  std::string token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rackrun::v1::JobService::Stub> jobs_;
  std::unique_ptr<rackrun::v1::RackControl::Stub> rack_;
};

// One fake worker daemon: registered, with its Assignments stream open (the scheduler
// only places jobs on workers whose stream is open).
class FakeWorker {
 public:
  FakeWorker(const std::string& address, const std::string& token, const std::string& host,
             int launcher_rank)
      : client_(address, token) {
    id_ = client_.Register(host, launcher_rank);
    stream_ctx_ = client_.Ctx(3600s);
    rackrun::v1::AssignmentsRequest a;
    a.set_worker_id(id_);
    stream_ = client_.rack().Assignments(stream_ctx_.get(), a);
    stream_->WaitForInitialMetadata();
  }
  ~FakeWorker() {
    client_.Deregister(id_);
    stream_ctx_->TryCancel();
    (void)stream_->Finish();
  }
  rackrun::v1::RunJob NextRun() {
    rackrun::v1::Assignment a;
    while (stream_->Read(&a)) {
      if (a.has_run()) return a.run();
    }
    Die("worker " + id_ + ": the Assignments stream ended before a job came");
  }
  void Result(const rackrun::v1::RunJob& run) {
    rackrun::v1::ReportRequest req;
    req.set_worker_id(id_);
    req.set_job_id(run.job_id());
    req.set_attempt(run.attempt());
    req.set_rank(run.rank());
    req.mutable_result()->set_outcome(rackrun::v1::AttemptResult::SUCCEEDED);
    rackrun::v1::ReportResponse resp;
    (void)client_.rack().Report(client_.Ctx().get(), req, &resp);
  }
  const std::string& id() const { return id_; }
  Client& client() { return client_; }

 private:
  Client client_;
  std::string id_;
  std::unique_ptr<grpc::ClientContext> stream_ctx_;
  std::unique_ptr<grpc::ClientReader<rackrun::v1::Assignment>> stream_;
};

rackrun::v1::JobSpec BaseSpec(const std::string& name, int ranks, int experts) {
  rackrun::v1::JobSpec s;
  s.set_name(name);
  auto* m = s.mutable_model();
  m->set_width(32);
  m->set_blocks(2);
  m->set_heads(2);
  m->set_seq_len(16);
  m->mutable_moe()->set_experts(experts);
  m->mutable_moe()->set_top_k(std::min(8, experts));
  s.mutable_data()->set_train("/data/train.tokens");
  s.mutable_training()->set_steps(1000000);
  s.mutable_resources()->set_ranks(ranks);
  return s;
}

std::string Submit(Client& client, const rackrun::v1::JobSpec& spec,
                   const std::string& request_id) {
  rackrun::v1::SubmitRequest req;
  *req.mutable_spec() = spec;
  req.set_request_id(request_id);
  rackrun::v1::SubmitResponse resp;
  grpc::Status s = client.jobs().Submit(client.Ctx().get(), req, &resp);
  if (!s.ok()) Die("Submit: " + s.error_message());
  return resp.job().id();
}

// ---- plan ----

struct PlanCell {
  int ranks = 0;
  std::string policy;
  std::string mode;
  std::vector<double> seconds;  // every rank's Solve calls after warm-up
  std::vector<uint64_t> rank0;  // rank 0's plan fingerprints, in order
  std::string error;
};

// Runs `solves` collective Solve calls on every rank (one thread each) of `sources`.
void RunSolves(const std::vector<rackrun::runtime::PlanSource*>& sources,
               const std::vector<rackrun::planner::TraceEntry>& trace, int warmup, int solves,
               PlanCell* cell) {
  const int ranks = static_cast<int>(sources.size());
  std::vector<std::vector<double>> per_rank(static_cast<size_t>(ranks));
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      rackrun::planner::LoadMatrix loads;
      rackrun::planner::Plan plan;
      for (int i = 0; i < warmup + solves; ++i) {
        const rackrun::planner::TraceEntry& entry = trace[static_cast<size_t>(i) % trace.size()];
        rackrun::runtime::PlanSource::Request req;
        req.microbatch = i;
        req.layer = entry.layer;
        req.training = true;
        req.local_loads =
            std::span<const int64_t>(entry.loads.row(r), static_cast<size_t>(entry.loads.experts));
        const auto start = MonotonicClock::now();
        absl::Status s = sources[static_cast<size_t>(r)]->Solve(req, &loads, &plan);
        const double took = rackrun::base::SecondsSince(start);
        if (!s.ok()) {
          errors[static_cast<size_t>(r)] =
              "rank " + std::to_string(r) + ": " + std::string(s.message());
          return;
        }
        if (i >= warmup) {
          per_rank[static_cast<size_t>(r)].push_back(took);
          if (r == 0) cell->rank0.push_back(rackrun::planner::PlanFingerprint(plan));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& v : per_rank) cell->seconds.insert(cell->seconds.end(), v.begin(), v.end());
  for (auto& e : errors) {
    if (!e.empty() && cell->error.empty()) cell->error = e;
  }
}

// Realistic loads (planner/generate.h) for `ranks` ranks: Zipf-skewed, calibrated to an
// initial rank imbalance (*target_imbalance), top-8, 4096 tokens per rank, 16 microbatches x
// 4 layers, cycled.
std::vector<rackrun::planner::TraceEntry> PlanTrace(int ranks, int experts,
                                                    double* target_imbalance) {
  rackrun::planner::GeneratorOptions gen;
  gen.ranks = ranks;
  gen.experts = experts;
  gen.topk = std::min(8, experts);
  gen.tokens_per_rank = 4096;
  gen.microbatches = 16;
  gen.layers = 4;
  gen.seed = 7;
  // 1.5, or the highest step of 0.05 below it that this domain can reach (R=2 cannot).
  absl::StatusOr<rackrun::planner::LoadGenerator> generator = absl::UnknownError("not tried");
  for (gen.imbalance = 1.5; gen.imbalance >= 1.04; gen.imbalance -= 0.05) {
    generator = rackrun::planner::LoadGenerator::Create(gen);
    if (generator.ok()) break;
  }
  if (!generator.ok()) Die("load generator: " + std::string(generator.status().message()));
  *target_imbalance = gen.imbalance;
  std::vector<rackrun::planner::TraceEntry> trace;
  for (int64_t mb = 0; mb < gen.microbatches; ++mb) {
    for (int layer = 0; layer < gen.layers; ++layer) {
      absl::StatusOr<rackrun::planner::TraceEntry> e = generator->Generate(mb, layer);
      if (!e.ok()) Die("load generator: " + std::string(e.status().message()));
      trace.push_back(*std::move(e));
    }
  }
  return trace;
}

// Coordinator mode: a job of `coord->ranks` fake workers on `coordinator`, its ranks' plan
// sources solving `trace` through it. Returns the job's balancer setup (the RunJob carries
// the defaulted spec), which the in-band source then uses too.
rackrun::jobspec::BalancerSetup CoordinatorCell(
    const Flags& flags, CoordinatorProcess& coordinator, Client& client, int job_index,
    const std::vector<rackrun::planner::TraceEntry>& trace, int warmup, PlanCell* coord) {
  const int ranks = coord->ranks;
  const std::string& policy = coord->policy;
  rackrun::v1::JobSpec spec = BaseSpec("plan-bench", ranks, flags.experts);
  spec.mutable_balancer()->set_policy(policy);
  spec.mutable_balancer()->set_mode("coordinator");
  std::vector<std::unique_ptr<FakeWorker>> workers;
  for (int r = 0; r < ranks; ++r) {
    const std::string host = "plan" + std::to_string(job_index) + "-h" + std::to_string(r);
    workers.push_back(
        std::make_unique<FakeWorker>(coordinator.address(), coordinator.token(), host, r));
  }
  const std::string job_id = Submit(client, spec, "plan-" + std::to_string(job_index));
  std::vector<rackrun::v1::RunJob> runs(static_cast<size_t>(ranks));
  for (auto& w : workers) {
    rackrun::v1::RunJob run = w->NextRun();
    if (run.job_id() != job_id) Die("worker got job " + run.job_id() + ", expected " + job_id);
    runs[static_cast<size_t>(run.rank())] = run;
  }
  if (!client.WaitState(job_id, rackrun::v1::RUNNING))
    Die("job " + job_id + " never became RUNNING");
  absl::StatusOr<rackrun::jobspec::BalancerSetup> setup =
      rackrun::jobspec::BalancerSetupOf(runs[0].spec(), ranks);
  if (!setup.ok()) Die("BalancerSetupOf: " + std::string(setup.status().message()));
  {
    std::vector<std::unique_ptr<rackrun::worker::Connection>> connections;
    std::vector<std::unique_ptr<rackrun::worker::CoordinatorPlanSource>> owned;
    std::vector<rackrun::runtime::PlanSource*> sources;
    for (int r = 0; r < ranks; ++r) {
      rackrun::worker::ConnectionOptions o;
      o.coordinator = coordinator.address();
      o.token_file = coordinator.token_file();
      absl::StatusOr<std::unique_ptr<rackrun::worker::Connection>> c =
          rackrun::worker::Connection::Create(o);
      if (!c.ok()) Die("Connection: " + std::string(c.status().message()));
      connections.push_back(*std::move(c));
      owned.push_back(std::make_unique<rackrun::worker::CoordinatorPlanSource>(
          *connections.back(), job_id, runs[static_cast<size_t>(r)].attempt(), r,
          /*expert_parallel=*/ranks));  // the bench's job is one domain
      sources.push_back(owned.back().get());
    }
    RunSolves(sources, trace, warmup, flags.solves, coord);
  }
  for (size_t r = 0; r < workers.size(); ++r) workers[r]->Result(runs[r]);
  (void)client.WaitState(job_id, rackrun::v1::SUCCEEDED);
  workers.clear();
  return *std::move(setup);
}

// In-band over Gloo on 127.0.0.1: `setup`'s planner on every rank, solving `trace`.
void InBandCell(const rackrun::jobspec::BalancerSetup& setup,
                const std::vector<rackrun::planner::TraceEntry>& trace, int warmup, int solves,
                PlanCell* inband) {
  const int ranks = inband->ranks;
  const std::string& policy = inband->policy;
  rackrun::comm::InMemoryRendezvousStore store;
  std::vector<std::unique_ptr<rackrun::comm::DataChannel>> channels(static_cast<size_t>(ranks));
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      rackrun::comm::GlooChannelOptions o;
      o.channel.timeout = absl::Seconds(60);
      o.address = "127.0.0.1";
      auto made = rackrun::comm::CreateGlooChannel(store, "bench/" + policy, r, ranks, o);
      if (made.ok()) {
        channels[static_cast<size_t>(r)] = *std::move(made);
      } else {
        errors[static_cast<size_t>(r)] = std::string(made.status().message());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (!e.empty()) Die("CreateGlooChannel: " + e);
  }
  std::vector<std::unique_ptr<rackrun::runtime::InBandPlanSource>> owned;
  std::vector<rackrun::runtime::PlanSource*> sources;
  for (int r = 0; r < ranks; ++r) {
    auto made = rackrun::runtime::InBandPlanSource::Create(
        *channels[static_cast<size_t>(r)], setup.domain, setup.policy->name, setup.planner);
    if (!made.ok()) Die("InBandPlanSource: " + std::string(made.status().message()));
    owned.push_back(*std::move(made));
    sources.push_back(owned.back().get());
  }
  RunSolves(sources, trace, warmup, solves, inband);
  owned.clear();
  channels.clear();
}

// The planner alone on this thread: the solve time of `setup`'s planner on `trace`.
json SolveOnly(const rackrun::jobspec::BalancerSetup& setup,
               const std::vector<rackrun::planner::TraceEntry>& trace, int warmup, int solves) {
  auto planner = rackrun::planner::MakePlanner(setup.policy->name, setup.domain, setup.planner);
  if (!planner.ok()) Die("MakePlanner: " + std::string(planner.status().message()));
  rackrun::planner::Plan plan;
  std::vector<double> seconds;
  for (int i = 0; i < warmup + solves; ++i) {
    const rackrun::planner::TraceEntry& entry = trace[static_cast<size_t>(i) % trace.size()];
    const auto start = MonotonicClock::now();
    absl::Status s = (*planner)->SolveInto(entry.loads, entry.layer, &plan);
    const double took = rackrun::base::SecondsSince(start);
    if (!s.ok()) Die("SolveInto: " + std::string(s.message()));
    if (i >= warmup) seconds.push_back(took);
  }
  return Micros(seconds);
}

// Bare unary ping-pongs against the coordinator: Heartbeat and Health.Check round trips.
json Pings(CoordinatorProcess& coordinator, int pings_wanted) {
  json pings = json::object();
  FakeWorker pinger(coordinator.address(), coordinator.token(), "ping-host", 0);
  std::vector<double> heartbeat, health;
  rackrun::v1::HeartbeatRequest hb;
  hb.set_worker_id(pinger.id());
  hb.set_phase("idle");
  for (int i = 0; i < pings_wanted + 50; ++i) {
    rackrun::v1::HeartbeatResponse resp;
    auto ctx = pinger.client().Ctx();
    const auto start = MonotonicClock::now();
    grpc::Status s = pinger.client().rack().Heartbeat(ctx.get(), hb, &resp);
    const double took = rackrun::base::SecondsSince(start);
    if (!s.ok()) Die("Heartbeat: " + s.error_message());
    if (i >= 50) heartbeat.push_back(took);
  }
  for (int i = 0; i < pings_wanted + 50; ++i) {
    const auto start = MonotonicClock::now();
    if (rackrun::rpc::CheckHealth(pinger.client().channel(), 5s) != 1) {
      Die("Health.Check did not say SERVING");
    }
    const double took = rackrun::base::SecondsSince(start);
    if (i >= 50) health.push_back(took);
  }
  pings["heartbeat"] = Micros(heartbeat);
  pings["health_check"] = Micros(health);
  return pings;
}

json RunPlan(const Flags& flags) {
  CoordinatorProcess coordinator(flags, "plan",
                                 {"--heartbeat-interval-ms", "1000", "--heartbeat-timeout-ms",
                                  "3600000", "--hang-timeout-ms", "3600000"});
  Client client(coordinator.address(), coordinator.token());
  const int warmup = std::max(10, flags.solves / 20);
  std::vector<PlanCell> cells;
  json solve_only = json::array();
  json imbalance = json::array();
  int job_index = 0;
  for (const int ranks : flags.ranks) {
    double target_imbalance = 0;
    const std::vector<rackrun::planner::TraceEntry> trace =
        PlanTrace(ranks, flags.experts, &target_imbalance);
    imbalance.push_back(json{{"ranks", ranks}, {"target_imbalance", target_imbalance}});
    for (const std::string& policy : flags.policies) {
      // Coordinator mode first: the RunJob carries the defaulted spec, whose BalancerSetup
      // the in-band source then uses too (the same domain and planner options).
      PlanCell coord{ranks, policy, "coordinator", {}, {}, {}};
      const rackrun::jobspec::BalancerSetup setup =
          CoordinatorCell(flags, coordinator, client, job_index++, trace, warmup, &coord);

      // In-band over Gloo on 127.0.0.1, with the same setup.
      PlanCell inband{ranks, policy, "inband", {}, {}, {}};
      InBandCell(setup, trace, warmup, flags.solves, &inband);

      // The planner alone on this thread: what either mode pays once per layer.
      json row = SolveOnly(setup, trace, warmup, flags.solves);
      row["ranks"] = ranks;
      row["policy"] = policy;
      solve_only.push_back(row);
      cells.push_back(std::move(inband));
      cells.push_back(std::move(coord));
    }
  }

  // Bare unary ping-pongs against the same coordinator, same run.
  const json pings = Pings(coordinator, flags.pings);

  json out;
  out["experts"] = flags.experts;
  out["solves_per_rank"] = flags.solves;
  out["loads"] = imbalance;
  out["cells"] = json::array();
  for (const PlanCell& c : cells) {
    json row = Micros(c.seconds);
    row["ranks"] = c.ranks;
    row["policy"] = c.policy;
    row["mode"] = c.mode;
    if (!c.error.empty()) row["error"] = c.error;
    out["cells"].push_back(row);
  }
  // Same plans in both modes (rank 0's fingerprints, solve by solve)?
  out["identical_plans"] = json::array();
  for (size_t i = 0; i + 1 < cells.size(); i += 2) {
    out["identical_plans"].push_back(
        json{{"ranks", cells[i].ranks},
             {"policy", cells[i].policy},
             {"identical", !cells[i].rank0.empty() && cells[i].rank0 == cells[i + 1].rank0}});
  }
  out["solve_only"] = solve_only;
  out["ping"] = pings;
  return out;
}

// ---- submit ----

json RunSubmit(const Flags& flags) {
  CoordinatorProcess coordinator(flags, "submit", {});
  Client client(coordinator.address(), coordinator.token());
  const rackrun::v1::JobSpec spec = BaseSpec("submit-bench", 1, 4);
  std::vector<double> seconds;
  const int warmup = 10;
  Stopwatch wall;
  for (int i = 0; i < warmup + flags.submits; ++i) {
    if (i == warmup) wall.Restart();
    rackrun::v1::SubmitRequest req;
    *req.mutable_spec() = spec;
    req.set_request_id("submit-" + std::to_string(i) + "-" + std::to_string(getpid()));
    rackrun::v1::SubmitResponse resp;
    auto ctx = client.Ctx();
    const auto start = MonotonicClock::now();
    grpc::Status s = client.jobs().Submit(ctx.get(), req, &resp);
    const double took = rackrun::base::SecondsSince(start);
    if (!s.ok()) Die("Submit: " + s.error_message());
    if (!resp.created()) Die("Submit with a fresh request id did not create a job");
    if (i >= warmup) seconds.push_back(took);
  }
  json out = Micros(seconds);
  out["submits_per_s"] = static_cast<double>(flags.submits) / wall.Seconds();
  out["state_dir_filesystem"] =
      FilesystemOf(std::filesystem::canonical(coordinator.state_dir()).string());
  return out;
}

// ---- heartbeat ----

json HeartbeatWindow(const Flags& flags, CoordinatorProcess& coordinator,
                     const std::vector<std::string>& ids, int interval_ms) {
  const int threads = std::max(1, std::min(flags.client_threads, static_cast<int>(ids.size())));
  std::atomic<bool> stop{false};
  std::vector<std::vector<double>> latencies(static_cast<size_t>(threads));
  std::vector<int64_t> ok(static_cast<size_t>(threads), 0), failed(static_cast<size_t>(threads), 0);
  std::vector<std::string> first_error(static_cast<size_t>(threads));
  const double cpu0 = coordinator.CpuSeconds();
  rusage self0{};
  getrusage(RUSAGE_SELF, &self0);
  Stopwatch wall;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      Client client(coordinator.address(), coordinator.token(), t + 1);
      std::vector<size_t> mine;
      for (size_t i = static_cast<size_t>(t); i < ids.size(); i += static_cast<size_t>(threads))
        mine.push_back(i);
      // Open loop: worker k of this thread is due at start + k * interval / n + j * interval.
      const auto start = MonotonicClock::now();
      const auto period = std::chrono::microseconds(int64_t{interval_ms} * 1000);
      std::vector<MonotonicClock::time_point> due(mine.size());
      for (size_t k = 0; k < mine.size(); ++k) {
        due[k] = start + period * static_cast<int64_t>(k) / static_cast<int64_t>(mine.size());
      }
      int64_t step = 0;
      size_t next = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        if (interval_ms > 0) {
          next = static_cast<size_t>(std::min_element(due.begin(), due.end()) - due.begin());
          std::this_thread::sleep_until(due[next]);
          due[next] += period;
        } else {
          next = (next + 1) % mine.size();
        }
        rackrun::v1::HeartbeatRequest hb;
        hb.set_worker_id(ids[mine[next]]);
        hb.set_phase("forward");
        hb.set_step(++step);
        hb.set_collectives_entered(step);
        hb.set_collectives_completed(step);
        hb.set_step_time_s(0.1);
        rackrun::v1::HeartbeatResponse resp;
        auto ctx = client.Ctx(5s);
        const auto sent = MonotonicClock::now();
        grpc::Status s = client.rack().Heartbeat(ctx.get(), hb, &resp);
        const double took = rackrun::base::SecondsSince(sent);
        if (s.ok()) {
          ++ok[static_cast<size_t>(t)];
          latencies[static_cast<size_t>(t)].push_back(took);
        } else {
          if (first_error[static_cast<size_t>(t)].empty())
            first_error[static_cast<size_t>(t)] = s.error_message();
          ++failed[static_cast<size_t>(t)];
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(flags.heartbeat_seconds));
  stop = true;
  for (auto& th : pool) th.join();
  const double seconds = wall.Seconds();
  const double cpu = coordinator.CpuSeconds() - cpu0;
  rusage self1{};
  getrusage(RUSAGE_SELF, &self1);
  auto tv = [](const timeval& v) {
    return static_cast<double>(v.tv_sec) + static_cast<double>(v.tv_usec) * 1e-6;
  };
  const double self_cpu =
      tv(self1.ru_utime) + tv(self1.ru_stime) - tv(self0.ru_utime) - tv(self0.ru_stime);
  std::vector<double> all;
  int64_t handled = 0, errors = 0;
  std::string error;
  for (int t = 0; t < threads; ++t) {
    all.insert(all.end(), latencies[static_cast<size_t>(t)].begin(),
               latencies[static_cast<size_t>(t)].end());
    handled += ok[static_cast<size_t>(t)];
    errors += failed[static_cast<size_t>(t)];
    if (error.empty()) error = first_error[static_cast<size_t>(t)];
  }
  json out = Micros(all);
  out["interval_ms"] = interval_ms;
  out["offered_per_s"] =
      interval_ms > 0 ? 1000.0 * static_cast<double>(ids.size()) / interval_ms : -1.0;
  out["window_s"] = seconds;
  out["handled"] = handled;
  out["handled_per_s"] = static_cast<double>(handled) / seconds;
  out["errors"] = errors;
  if (!error.empty()) out["first_error"] = error;
  out["coordinator_cpu_pct"] = 100.0 * cpu / seconds;
  out["coordinator_cpu_us_per_heartbeat"] =
      handled > 0 ? 1e6 * cpu / static_cast<double>(handled) : 0.0;
  out["load_generator_cpu_pct"] = 100.0 * self_cpu / seconds;
  return out;
}

json RunHeartbeat(const Flags& flags) {
  const int interval = std::max(1, flags.heartbeat_interval_ms);
  CoordinatorProcess coordinator(
      flags, "heartbeat",
      {"--heartbeat-interval-ms", std::to_string(interval), "--heartbeat-timeout-ms", "3600000",
       "--hang-timeout-ms", "3600000"});
  Client client(coordinator.address(), coordinator.token());
  std::vector<std::string> ids;
  for (int i = 0; i < flags.workers; ++i)
    ids.push_back(client.Register("hb-host-" + std::to_string(i), i));
  json out;
  out["workers"] = flags.workers;
  out["client_threads"] = flags.client_threads;
  out["open_loop"] = HeartbeatWindow(flags, coordinator, ids, interval);
  out["closed_loop"] = HeartbeatWindow(flags, coordinator, ids, 0);
  return out;
}

// ---- watch ----

json RunWatch(const Flags& flags) {
  CoordinatorProcess coordinator(flags, "watch",
                                 {"--heartbeat-interval-ms", "1000", "--heartbeat-timeout-ms",
                                  "3600000", "--hang-timeout-ms", "3600000"});
  Client client(coordinator.address(), coordinator.token());
  FakeWorker worker(coordinator.address(), coordinator.token(), "watch-host", 0);
  const std::string job_id = Submit(client, BaseSpec("watch-bench", 1, 4), "watch-1");
  const rackrun::v1::RunJob run = worker.NextRun();
  if (!client.WaitState(job_id, rackrun::v1::RUNNING)) Die("watch job never became RUNNING");

  const int max_steps =
      static_cast<int>(flags.watch_seconds * 1000.0 / std::max(1, flags.progress_every_ms)) + 16;
  // Send time of each step's Report, written before the call (so before the event exists).
  std::vector<std::atomic<double>> sent(static_cast<size_t>(max_steps) + 1);
  for (auto& s : sent) s.store(0);
  // When each step's Report returned (the event was committed by then); 0 until it has.
  std::vector<std::atomic<double>> acked(static_cast<size_t>(max_steps) + 1);
  for (auto& s : acked) s.store(0);

  struct Stream {
    std::vector<int64_t> seqs;
    std::vector<double> latency;
    std::vector<std::pair<int64_t, double>> read_at;  // (step, time read)
    std::atomic<int> received{0};
    grpc::Status status;
  };
  const int watchers = flags.watchers;
  const int connections = std::max(1, std::min(10, watchers));
  std::vector<std::unique_ptr<Client>> clients;
  for (int c = 0; c < connections; ++c) {
    clients.push_back(
        std::make_unique<Client>(coordinator.address(), coordinator.token(), 1000 + c));
  }
  std::vector<Stream> streams(static_cast<size_t>(watchers));
  std::vector<std::thread> readers;
  for (int k = 0; k < watchers; ++k) {
    readers.emplace_back([&, k] {
      Client& c = *clients[static_cast<size_t>(k % connections)];
      Stream& st = streams[static_cast<size_t>(k)];
      rackrun::v1::WatchJobRequest req;
      req.set_job_id(job_id);
      auto ctx = c.Ctx(600s);
      auto reader = c.jobs().Watch(ctx.get(), req);
      rackrun::v1::JobEvent ev;
      while (reader->Read(&ev)) {
        const double now = NowSeconds();
        st.seqs.push_back(ev.seq());
        if (ev.has_progress()) {
          const int64_t step = ev.progress().step();
          if (step >= 1 && step <= max_steps) {
            const double at = sent[static_cast<size_t>(step)].load(std::memory_order_acquire);
            if (at > 0) st.latency.push_back(now - at);
            st.read_at.emplace_back(step, now);
          }
        }
        st.received.fetch_add(1, std::memory_order_release);
      }
      st.status = reader->Finish();
    });
  }
  // Every stream has replayed the job's first events (QUEUED, RUNNING) before progress starts.
  const auto ready_by = MonotonicClock::now() + 30s;
  for (auto& st : streams) {
    while (st.received.load(std::memory_order_acquire) < 2 && MonotonicClock::now() < ready_by) {
      std::this_thread::sleep_for(1ms);
    }
  }
  // The reporter: rank 0's progress every P ms (open loop, no catch-up bursts).
  std::vector<double> report_seconds;
  int steps = 0;
  Stopwatch wall;
  auto due = MonotonicClock::now();
  while (wall.Seconds() < flags.watch_seconds && steps < max_steps) {
    std::this_thread::sleep_until(due);
    due = std::max(due + std::chrono::milliseconds(flags.progress_every_ms), MonotonicClock::now());
    ++steps;
    rackrun::v1::ReportRequest req;
    req.set_worker_id(worker.id());
    req.set_job_id(job_id);
    req.set_attempt(run.attempt());
    req.set_rank(0);
    req.mutable_progress()->set_step(steps);
    req.mutable_progress()->set_total_steps(1000000);
    req.mutable_progress()->set_loss(2.5);
    rackrun::v1::ReportResponse resp;
    auto ctx = worker.client().Ctx();
    sent[static_cast<size_t>(steps)].store(NowSeconds(), std::memory_order_release);
    const auto start = MonotonicClock::now();
    grpc::Status s = worker.client().rack().Report(ctx.get(), req, &resp);
    report_seconds.push_back(rackrun::base::SecondsSince(start));
    acked[static_cast<size_t>(steps)].store(NowSeconds(), std::memory_order_release);
    if (!s.ok()) Die("Report: " + s.error_message());
  }
  const double reporting_s = wall.Seconds();
  worker.Result(run);
  for (auto& t : readers) t.join();

  // Every stream: seq 1..last without gaps or repeats, the same last seq on all, every step.
  const rackrun::v1::Job job = client.Get(job_id);
  int complete = 0;
  int64_t last_seq = -1;
  std::vector<double> latency;
  // Read time minus the Report's return: the fan-out alone (negative when a stream read the
  // event before the reporter saw its reply).
  std::vector<double> after_ack;
  std::string problem;
  for (int k = 0; k < watchers; ++k) {
    const Stream& st = streams[static_cast<size_t>(k)];
    bool in_order = st.status.ok() && !st.seqs.empty();
    for (size_t i = 0; in_order && i < st.seqs.size(); ++i)
      in_order = st.seqs[i] == static_cast<int64_t>(i + 1);
    if (last_seq < 0 && !st.seqs.empty()) last_seq = st.seqs.back();
    if (in_order && st.seqs.back() == last_seq && st.latency.size() == static_cast<size_t>(steps)) {
      ++complete;
    } else if (problem.empty()) {
      problem = "stream " + std::to_string(k) + ": " + std::to_string(st.seqs.size()) +
                " events, " + std::to_string(st.latency.size()) + " of " + std::to_string(steps) +
                " progress events, status '" + st.status.error_message() + "'";
    }
    latency.insert(latency.end(), st.latency.begin(), st.latency.end());
    for (const auto& [step, at] : st.read_at) {
      after_ack.push_back(at - acked[static_cast<size_t>(step)].load(std::memory_order_acquire));
    }
  }
  json out = Micros(latency);
  out["watchers"] = watchers;
  out["connections"] = connections;
  out["progress_events"] = steps;
  out["progress_per_s"] = static_cast<double>(steps) / reporting_s;
  out["events_per_stream"] = last_seq;
  out["streams_complete_in_order"] = complete;
  out["job_state"] = rackrun::v1::JobState_Name(job.state());
  out["report_rpc"] = Micros(report_seconds);
  out["after_report_returned"] = Micros(after_ack);
  if (!problem.empty()) out["first_problem"] = problem;
  return out;
}

void PrintTables(const json& out) {
  std::printf("machine: %s\n", out["machine"].get<std::string>().c_str());
  if (out.contains("plan")) {
    const json& p = out["plan"];
    std::printf(
        "\nplan round trip per (microbatch, layer), %d experts, %d solves per rank (all ranks "
        "pooled)\n",
        p["experts"].get<int>(), p["solves_per_rank"].get<int>());
    std::printf("%-6s %-8s %-12s %10s %10s %10s\n", "ranks", "policy", "mode", "p50 us", "p99 us",
                "max us");
    for (const json& c : p["cells"]) {
      std::printf("%-6d %-8s %-12s %10.1f %10.1f %10.1f%s\n", c["ranks"].get<int>(),
                  c["policy"].get<std::string>().c_str(), c["mode"].get<std::string>().c_str(),
                  c["p50_us"].get<double>(), c["p99_us"].get<double>(), c["max_us"].get<double>(),
                  c.contains("error") ? ("  ERROR " + c["error"].get<std::string>()).c_str() : "");
    }
    for (const json& l : p["loads"]) {
      std::printf("loads R=%d: generated at initial max/mean %.2f\n", l["ranks"].get<int>(),
                  l["target_imbalance"].get<double>());
    }
    for (const json& s : p["solve_only"]) {
      std::printf("solve only (planner on one thread) R=%d %-8s p50 %.1f us p99 %.1f us\n",
                  s["ranks"].get<int>(), s["policy"].get<std::string>().c_str(),
                  s["p50_us"].get<double>(), s["p99_us"].get<double>());
    }
    for (const json& s : p["identical_plans"]) {
      std::printf("plans identical in both modes R=%d %-8s %s\n", s["ranks"].get<int>(),
                  s["policy"].get<std::string>().c_str(),
                  s["identical"].get<bool>() ? "yes" : "NO");
    }
    for (const char* name : {"heartbeat", "health_check"}) {
      const json& g = p["ping"][name];
      std::printf("bare unary ping-pong (%s): p50 %.1f us p99 %.1f us (n=%d)\n", name,
                  g["p50_us"].get<double>(), g["p99_us"].get<double>(), g["n"].get<int>());
    }
  }
  if (out.contains("submit")) {
    const json& s = out["submit"];
    std::printf(
        "\nSubmit (sequential, fresh request ids, state dir on %s): n=%d p50 %.0f us p99 %.0f us "
        "max %.0f us, "
        "%.1f submits/s\n",
        s["state_dir_filesystem"].get<std::string>().c_str(), s["n"].get<int>(),
        s["p50_us"].get<double>(), s["p99_us"].get<double>(), s["max_us"].get<double>(),
        s["submits_per_s"].get<double>());
  }
  if (out.contains("heartbeat")) {
    const json& h = out["heartbeat"];
    std::printf("\nheartbeats: %d workers, %d client threads\n", h["workers"].get<int>(),
                h["client_threads"].get<int>());
    std::printf("%-22s %10s %10s %8s %10s %10s %10s %12s\n", "load", "offered/s", "handled/s",
                "errors", "p50 us", "p99 us", "coord CPU%", "gen CPU%");
    for (const char* name : {"open_loop", "closed_loop"}) {
      const json& w = h[name];
      const std::string label = w["interval_ms"].get<int>() > 0
                                    ? "every " + std::to_string(w["interval_ms"].get<int>()) + " ms"
                                    : std::string("closed loop");
      std::printf("%-22s %10.0f %10.0f %8lld %10.1f %10.1f %10.1f %12.1f\n", label.c_str(),
                  w["offered_per_s"].get<double>(), w["handled_per_s"].get<double>(),
                  static_cast<long long>(w["errors"].get<int64_t>()), w["p50_us"].get<double>(),
                  w["p99_us"].get<double>(), w["coordinator_cpu_pct"].get<double>(),
                  w["load_generator_cpu_pct"].get<double>());
    }
  }
  if (out.contains("watch")) {
    const json& w = out["watch"];
    std::printf(
        "\nwatch: %d streams over %d connections, %d progress events (%.0f/s), %lld events per "
        "stream\n",
        w["watchers"].get<int>(), w["connections"].get<int>(), w["progress_events"].get<int>(),
        w["progress_per_s"].get<double>(),
        static_cast<long long>(w["events_per_stream"].get<int64_t>()));
    std::printf(
        "delivery latency (Report sent -> event read): p50 %.0f us p99 %.0f us max %.0f us "
        "(n=%d)\n",
        w["p50_us"].get<double>(), w["p99_us"].get<double>(), w["max_us"].get<double>(),
        w["n"].get<int>());
    std::printf("Report RPC (one SQLite commit each): p50 %.0f us p99 %.0f us\n",
                w["report_rpc"]["p50_us"].get<double>(), w["report_rpc"]["p99_us"].get<double>());
    std::printf("event read minus Report returned (fan-out alone): p50 %.0f us p99 %.0f us\n",
                w["after_report_returned"]["p50_us"].get<double>(),
                w["after_report_returned"]["p99_us"].get<double>());
    std::printf("streams with every event once, in order: %d of %d%s\n",
                w["streams_complete_in_order"].get<int>(), w["watchers"].get<int>(),
                w.contains("first_problem")
                    ? ("  first problem: " + w["first_problem"].get<std::string>()).c_str()
                    : "");
  }
}

}  // namespace

int main(int argc, char** argv) {
  rackrun::base::IgnoreSigpipe();
  Flags flags;
  rackrun::bench::BenchStartup bench(
      argc, argv,
      "The coordinator and worker control plane against a real rackrun-coordinator child on\n"
      "127.0.0.1: plan round trips, submits, heartbeats and watch streams (this file's header\n"
      "says what each part measures).\n");
  rackrun::flags::FlagSet& f = bench.flags();
  f.List("--only", &flags.only, "LIST", "the parts to run: plan, submit, heartbeat, watch");
  f.String("--coordinator", &flags.coordinator, "PATH", "the rackrun-coordinator binary");
  f.String("--scratch", &flags.scratch, "DIR", "where the coordinator's state folder goes");
  f.Section("plan");
  f.List("--ranks", &flags.ranks, "LIST", "rank counts").Range(1);
  f.List("--policy", &flags.policies, "LIST", "balancing policies");
  f.Int("--experts", &flags.experts, "N", "experts").Range(1);
  f.Int("--solves", &flags.solves, "N", "plan solves per cell").Range(1);
  f.Int("--pings", &flags.pings, "N", "bare unary ping-pongs").Range(1);
  f.Section("submit");
  f.Int("--submits", &flags.submits, "N", "sequential submits").Range(1);
  f.Section("heartbeat");
  f.Int("--workers", &flags.workers, "N", "registered workers").Range(1);
  f.Int("--client-threads", &flags.client_threads, "N", "heartbeating client threads").Range(1);
  f.Int("--heartbeat-interval-ms", &flags.heartbeat_interval_ms, "MS", "open-loop interval")
      .Range(1);
  f.Double("--heartbeat-seconds", &flags.heartbeat_seconds, "S", "length of each window")
      .Range(0.1);
  f.Section("watch");
  f.Int("--watchers", &flags.watchers, "N", "Watch streams on one job").Range(1);
  f.Int("--progress-every-ms", &flags.progress_every_ms, "MS", "progress report period").Range(1);
  f.Double("--watch-seconds", &flags.watch_seconds, "S", "how long progress is reported")
      .Range(0.1);
  if (std::optional<int> exit = bench.Start()) return *exit;
  auto wants = [&](std::string_view part) {
    return std::find(flags.only.begin(), flags.only.end(), part) != flags.only.end();
  };
  json out;
  out["machine"] = rackrun::bench::MachineLine();
  if (wants("plan")) out["plan"] = RunPlan(flags);
  if (wants("submit")) out["submit"] = RunSubmit(flags);
  if (wants("heartbeat")) out["heartbeat"] = RunHeartbeat(flags);
  if (wants("watch")) out["watch"] = RunWatch(flags);
  out["machine_after"] = rackrun::bench::MachineLine();
  if (bench.json()) {
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    PrintTables(out);
    std::printf("machine after: %s\n", out["machine_after"].get<std::string>().c_str());
  }
  return 0;
}
