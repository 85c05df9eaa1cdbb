// The built-in dashboard at cluster scale, in a real headless Chromium: the coordinator's
// dashboard server (metrics::Dashboard, the real page and uPlot from metrics/dashboard)
// over an in-memory source holding what a busy coordinator holds: 120 jobs in every state
// and a running 64-rank job of 4 expert-parallel domains of 16 ranks with its progress
// events and 64 busy workers. tests/metrics/dashboard_check.mjs (cluster mode) checks the
// job table (running first, then newest first; 10 rows a page, prev/next through all 120;
// the state filter), numbers for people (28.8k, no exponents), the charts above the fold
// of a 1400x900 window, and the domain views (4 heatmap pairs, 4 x 16 rank cells with
// their values in titles), and the GPU panel saying "no GPU" for the CPU job. The source
// stands in for the coordinator's Rack: making 120 real finished jobs would take the suite
// minutes; the daemons' path to this page is metrics_observability_test's.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "metrics/dashboard.h"
#include "tests/support/shell.h"

namespace rackrun::metrics {
namespace {

namespace fs = std::filesystem;
using rackrun::v1::Job;
using rackrun::v1::JobEvent;
using rackrun::v1::JobState;

constexpr int kJobs = 120;
constexpr int kRanks = 64;
constexpr int kRanksPerDomain = 16;
constexpr int kLayers = 4;
constexpr int kSteps = 30;
constexpr int64_t kCreated0 = 1764000000000;  // ms; job j-i was created i minutes later
constexpr char kWide[] = "j-77";              // the running 64-rank job (not the newest)

// Job i's state: 3 running (the 64-rank one among them), 5 queued, 19 failed, 12
// cancelled, the rest succeeded, interleaved so that every page mixes them.
JobState StateOf(int i) {
  if (i == 77 || i == 31 || i == 100) return rackrun::v1::RUNNING;
  if (i > 115) return rackrun::v1::QUEUED;
  if (i % 6 == 0) return rackrun::v1::FAILED;
  if (i % 10 == 5) return rackrun::v1::CANCELLED;
  return rackrun::v1::SUCCEEDED;
}

// Domain d's per-layer imbalance and per-rank tokens at a step: domain 2 is the worst.
rackrun::v1::StepProgress Progress(int step) {
  rackrun::v1::StepProgress p;
  p.set_step(step);
  p.set_total_steps(500);
  p.set_loss(5.0 - 0.05 * step);
  p.set_tokens_per_s(28781.3);
  p.set_step_time_s(0.12);
  p.set_plan_s(3.4e-3);
  p.set_plan_exchange_s(2.1e-3);
  p.set_fanout_s(1.2e-3);
  p.set_dispatch_s(8.6e-3);
  p.set_reduce_s(4e-4);
  p.set_fanout_bytes(3 << 20);
  p.set_replicas(5);
  for (int d = 0; d < kRanks / kRanksPerDomain; ++d) {
    rackrun::v1::DomainProgress* dom = p.add_domains();
    dom->set_domain(d);
    dom->set_first_rank(d * kRanksPerDomain);
    dom->set_ranks(kRanksPerDomain);
    for (int l = 0; l < kLayers; ++l) {
      dom->add_imbalance_before(1.3 + 0.2 * d + 0.05 * l + 0.01 * (step % 5));
      dom->add_imbalance_after(1.01 + 0.01 * d);
    }
    for (int r = 0; r < kRanksPerDomain; ++r) {
      dom->add_rank_tokens_before(10000.0 + 2500.0 * ((r * 7 + d) % 5));
      dom->add_rank_tokens_after(15000.0 + 37.0 * (r % 3));
    }
  }
  if (!p.domains().empty()) {
    *p.mutable_imbalance_before() = p.domains(0).imbalance_before();
    *p.mutable_imbalance_after() = p.domains(0).imbalance_after();
  }
  rackrun::v1::ExpertLoadSample* s = p.add_expert_loads();
  s->set_layer(0);
  for (int e = 0; e < 64; ++e) s->add_tokens(1000 + 130 * ((e * 11 + step) % 17));
  return p;
}

class ClusterSource final : public DashboardSource {
 public:
  absl::StatusOr<rackrun::v1::ListJobsResponse> ListJobs() override {
    rackrun::v1::ListJobsResponse r;
    for (int i = kJobs; i >= 1; --i)
      *r.add_jobs() = MakeJob(i);  // newest first, as the coordinator
    return r;
  }
  absl::StatusOr<Job> GetJob(const std::string& id) override {
    for (int i = 1; i <= kJobs; ++i) {
      if (id == absl::StrCat("j-", i)) return MakeJob(i);
    }
    return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
  }
  absl::Status Events(const std::string& id, int64_t after, std::vector<JobEvent>* out,
                      bool* done) override {
    if (!GetJob(id).ok()) return absl::NotFoundError("no such job");
    *done = false;
    if (id != kWide) return absl::OkStatus();
    for (int64_t seq = after + 1; seq <= kSteps; ++seq) {
      JobEvent e;
      e.set_seq(seq);
      e.set_job_id(id);
      e.set_attempt(1);
      *e.mutable_progress() = Progress(static_cast<int>(seq));
      out->push_back(e);
    }
    return absl::OkStatus();
  }
  rackrun::v1::ListWorkersResponse ListWorkers() override {
    rackrun::v1::ListWorkersResponse r;
    for (int w = 0; w < kRanks; ++w) {
      rackrun::v1::Worker* worker = r.add_workers();
      worker->set_id(absl::StrCat("w-", w + 1));
      worker->set_host(absl::StrCat("node", w / 8));
      worker->set_pid(1000 + w);
      worker->set_state(rackrun::v1::BUSY);
      worker->set_job_id(kWide);
      worker->set_rank(w);
      worker->set_phase("forward_backward");
      worker->set_step(kSteps);
      worker->set_step_time_s(w == 37 ? 0.31 : 0.12 + 0.001 * (w % 4));  // rank 37 straggles
      worker->set_heartbeat_age_s(0.4);
    }
    return r;
  }

 private:
  static Job MakeJob(int i) {
    Job j;
    j.set_id(absl::StrCat("j-", i));
    j.set_name(absl::StrCat("sweep-", i));
    j.set_state(StateOf(i));
    j.set_created_unix_ms(kCreated0 + 60000LL * i);
    j.set_restarts(i % 7 == 0 ? 1 : 0);
    if (StateOf(i) != rackrun::v1::QUEUED) {
      rackrun::v1::StepProgress* p = j.mutable_last_progress();
      p->set_step(std::string(j.id()) == kWide ? kSteps : 500);
      p->set_total_steps(500);
      p->set_loss(2.0 + 0.001 * i);
      p->set_tokens_per_s(28781.3 + 1000.0 * (i % 3));
    }
    return j;
  }
};

TEST(DashboardPageTest, HundredsOfJobsAndSixtyFourRanksStayReadable) {
  const fs::path dir =
      fs::temp_directory_path() / absl::StrCat("rackrun-dashboard-page-", getpid());
  fs::create_directories(dir);
  ClusterSource source;
  Dashboard::Options options;
  options.listen = "127.0.0.1:0";
  options.assets_dir = RACKRUN_DASHBOARD_ASSETS;
  absl::StatusOr<std::unique_ptr<Dashboard>> dashboard = Dashboard::Start(options, &source);
  ASSERT_TRUE(dashboard.ok()) << dashboard.status();
  const std::string shot = std::string(RACKRUN_BUILD_DIR) + "/metrics-dashboard-cluster.png";
  const std::string expect =
      absl::StrCat(R"('{"jobs": )", kJobs, R"(, "page": 10, "running": 3, "failed": 19, )",
                   R"("domains": 4, "ranks_per_domain": 16, "text": "28.8k", )",
                   R"("gpu": "no GPU: this job runs on the CPU"}')");
  const ::rackrun::testing::ShellResult browser = ::rackrun::testing::Shell(
      absl::StrCat("timeout -k 5 90 ", NODE_BINARY, " ", RACKRUN_SOURCE_DIR,
                   "/tests/metrics/dashboard_check.mjs ", CHROMIUM_BINARY, " 'http://127.0.0.1:",
                   (*dashboard)->port(), "/#job=", kWide, "' ", shot, " 60 ", expect),
      dir / "browser.stdout", dir / "browser.stderr");
  EXPECT_EQ(browser.code, 0) << browser.out << browser.err;
  std::cout << browser.out;
  EXPECT_TRUE(fs::exists(shot) && fs::file_size(shot) > 10000) << shot;
  if (!HasFailure()) fs::remove_all(dir);
}

}  // namespace
}  // namespace rackrun::metrics
