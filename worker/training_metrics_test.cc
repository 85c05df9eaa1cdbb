// The worker's per-job series (TrainingMetrics) scraped from a real exporter and held
// against the metrics contract (metrics/expected_series.h), and the model FLOPs behind MFU.
#include "worker/training_metrics.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "metrics/expected_series.h"
#include "metrics/exporter.h"
#include "metrics/scrape.h"
#include "metrics/series_checks.h"

namespace rackrun::worker {
namespace {

using metrics::ExpectedSeries;
using metrics::ExpectNaming;
using metrics::ExpectSeries;
using metrics::MetricFamily;
using metrics::Sample;
using metrics::WorkerGpuSeries;
using metrics::WorkerLayerSeries;
using metrics::WorkerSeries;

// Every rank's observer of job `job_id` (`ranks` ranks, `g` per domain; 0 = one domain),
// with FLOP/s and MFU series, in the phases forward_backward then optimizer.
std::vector<std::unique_ptr<TrainingMetrics>> MakeRanks(prometheus::Registry& registry,
                                                        const std::string& job_id, int ranks,
                                                        int g) {
  std::vector<std::unique_ptr<TrainingMetrics>> out;
  for (int r = 0; r < ranks; ++r) {
    TrainingMetrics::Options o;
    o.job_id = job_id;
    o.rank = r;
    o.ranks = ranks;
    o.expert_parallel = g;
    o.flops_per_token = 6e6;
    o.peak_flops = 1e12;
    o.total_steps = 10;
    out.push_back(std::make_unique<TrainingMetrics>(registry, o));
    out.back()->SetPhase("forward_backward");
    out.back()->SetPhase("optimizer");
  }
  return out;
}

TEST(TrainingMetricsTest, WorkerExportsItsSeries) {
  absl::StatusOr<std::unique_ptr<metrics::MetricsExporter>> ex =
      metrics::MetricsExporter::Start("127.0.0.1:0");
  ASSERT_TRUE(ex.ok()) << ex.status();
  std::vector<std::unique_ptr<TrainingMetrics>> ranks = MakeRanks((*ex)->registry(), "j-3", 2, 0);
  for (int step = 1; step <= 3; ++step) {
    runtime::StepRecord rec;
    rec.step = step;
    rec.total_steps = 10;
    rec.loss = 5.0 - step;
    rec.lr = 1e-3;
    rec.grad_norm = 0.5;
    rec.step_s = 0.25;
    rec.tokens = 1000;
    rec.ranks = 2;
    rec.rank_imbalance_before = {1.8, 1.4};
    rec.rank_imbalance_after = {1.02, 1.01};
    rec.replicas = 3;
    rec.plan_s = 4e-5;
    rec.plan_exchange_s = 3e-5;
    rec.fanout_s = 1e-3;
    rec.dispatch_s = 2e-3;
    rec.reduce_s = 5e-4;
    if (step == 2) rec.val_loss = 3.5;
    for (auto& m : ranks) m->OnStep(rec);
  }
  ranks[0]->ObservePlanRoundTrip(2e-4);
  std::map<std::string, MetricFamily> got = metrics::ScrapeMetrics((*ex)->port());
  ExpectSeries(got, WorkerSeries());
  ExpectSeries(got, WorkerLayerSeries());
  ExpectNaming(got);
  for (const Sample& s : got["rackrun_train_tokens_total"].samples)
    EXPECT_EQ(s.value, 1500);  // 3 x 1000 / 2
  for (const Sample& s : got["rackrun_train_mfu_ratio"].samples) {
    EXPECT_NEAR(s.value, 6e6 * 500 / 0.25 / 1e12, 1e-9);
    EXPECT_GT(s.value, 0);
    EXPECT_LE(s.value, 1);
  }
  EXPECT_EQ(got["rackrun_moe_last_imbalance_before"].samples.size(), 2u)
      << "rank 0 only (one domain), one per layer";
  for (const Sample& s : got["rackrun_moe_last_imbalance_before"].samples)
    EXPECT_EQ(s.labels.at("domain"), "0");
  for (const Sample& s : got["rackrun_train_phase"].samples) {
    EXPECT_EQ(s.value, s.labels.at("phase") == "optimizer" ? 1 : 0);
  }
  // Every rank observed 3 steps of 3e-5 s in the load exchange.
  int exchange_sums = 0;
  for (const Sample& s : got["rackrun_moe_plan_exchange_seconds"].samples) {
    if (s.name == "rackrun_moe_plan_exchange_seconds_sum") {
      EXPECT_NEAR(s.value, 9e-5, 1e-12);
      ++exchange_sums;
    } else if (s.name == "rackrun_moe_plan_exchange_seconds_count") {
      EXPECT_EQ(s.value, 3);
    }
  }
  EXPECT_EQ(exchange_sums, 2) << "one per rank";
  EXPECT_EQ(got["rackrun_train_validation_loss"].samples.size(), 2u);
  EXPECT_EQ(got["rackrun_train_step"].samples.at(0).value, 3);

  ranks.clear();  // the job's series go with its observers
  got = metrics::ScrapeMetrics((*ex)->port());
  for (const ExpectedSeries& e : WorkerSeries()) EXPECT_TRUE(got[e.name].samples.empty()) << e.name;
}

// Four ranks as 2 expert-parallel domains of 2: every balancing series names the rank's
// domain, and each domain's first rank (0 and 2) exports its domain's per-layer series.
TEST(TrainingMetricsTest, DomainsLabelBalancingSeriesAndEachDomainExportsItsLayers) {
  absl::StatusOr<std::unique_ptr<metrics::MetricsExporter>> ex =
      metrics::MetricsExporter::Start("127.0.0.1:0");
  ASSERT_TRUE(ex.ok()) << ex.status();
  std::vector<std::unique_ptr<TrainingMetrics>> ranks = MakeRanks((*ex)->registry(), "j-7", 4, 2);
  for (int r = 0; r < 4; ++r) {
    runtime::StepRecord rec;
    rec.step = 1;
    rec.step_s = 0.5;
    rec.tokens = 4000;
    rec.ranks = 4;
    // Each rank's record holds its own domain's imbalance (domain 1's is worse).
    const int domain = r / 2;
    rec.rank_imbalance_before = {1.5 + domain, 1.25 + domain};
    rec.rank_imbalance_after = {1.0 + 0.5 * domain, 1.125};
    rec.plan_s = 1e-3 * (r + 1);
    ranks[static_cast<size_t>(r)]->OnStep(rec);
  }
  ranks[3]->ObservePlanRoundTrip(2e-4);
  std::map<std::string, MetricFamily> got = metrics::ScrapeMetrics((*ex)->port());
  ExpectSeries(got, WorkerSeries());
  ExpectSeries(got, WorkerLayerSeries());
  ExpectNaming(got);
  // 2 layers x 2 domains, from ranks 0 and 2 only.
  std::map<std::pair<std::string, std::string>, double> before, after;
  for (const Sample& s : got["rackrun_moe_last_imbalance_before"].samples) {
    before[{s.labels.at("domain"), s.labels.at("layer")}] = s.value;
    EXPECT_EQ(s.labels.count("rank"), 0u);
  }
  for (const Sample& s : got["rackrun_moe_last_imbalance_after"].samples) {
    after[{s.labels.at("domain"), s.labels.at("layer")}] = s.value;
  }
  const std::map<std::pair<std::string, std::string>, double> want_before = {
      {{"0", "0"}, 1.5}, {{"0", "1"}, 1.25}, {{"1", "0"}, 2.5}, {{"1", "1"}, 2.25}};
  const std::map<std::pair<std::string, std::string>, double> want_after = {
      {{"0", "0"}, 1.0}, {{"0", "1"}, 1.125}, {{"1", "0"}, 1.5}, {{"1", "1"}, 1.125}};
  EXPECT_EQ(before, want_before);
  EXPECT_EQ(after, want_after);
  // Per-rank balancing series carry domain = rank / 2; training series do not.
  int plan_counts = 0;
  for (const Sample& s : got["rackrun_moe_plan_seconds"].samples) {
    EXPECT_EQ(s.labels.at("domain"), std::to_string(std::stoi(s.labels.at("rank")) / 2)) << s.name;
    if (s.name == "rackrun_moe_plan_seconds_sum") {
      EXPECT_NEAR(s.value, 1e-3 * (std::stoi(s.labels.at("rank")) + 1), 1e-12);
      ++plan_counts;
    }
  }
  EXPECT_EQ(plan_counts, 4);
  ASSERT_EQ(got["rackrun_moe_plan_round_trip_seconds"].samples.empty(), false);
  for (const Sample& s : got["rackrun_moe_plan_round_trip_seconds"].samples) {
    EXPECT_EQ(s.labels.at("rank"), "3");
    EXPECT_EQ(s.labels.at("domain"), "1");
  }
  for (const Sample& s : got["rackrun_train_loss"].samples) EXPECT_EQ(s.labels.count("domain"), 0u);
}

// A GPU job (one rank): the device figures of each step become the rackrun_gpu_* series,
// in seconds and bytes; a CPU job has none. The figures here are a DeviceStepStats as the
// GPU engine fills it (runtime/cuda/engine.cc); the engine's own run is
// tests/daemons/gpu_daemons_test.cc (label gpu, not run on a GPU yet).
TEST(TrainingMetricsTest, GpuJobsExportDeviceMemoryAndPhaseSeconds) {
  absl::StatusOr<std::unique_ptr<metrics::MetricsExporter>> ex =
      metrics::MetricsExporter::Start("127.0.0.1:0");
  ASSERT_TRUE(ex.ok()) << ex.status();
  std::vector<std::unique_ptr<TrainingMetrics>> ranks = MakeRanks((*ex)->registry(), "j-9", 1, 0);
  runtime::StepRecord rec;
  rec.step = 1;
  rec.step_s = 0.1;
  rec.tokens = 256;
  rec.ranks = 1;
  ranks[0]->OnStep(rec);
  std::map<std::string, MetricFamily> got = metrics::ScrapeMetrics((*ex)->port());
  for (const ExpectedSeries& e : WorkerGpuSeries()) {
    EXPECT_TRUE(got[e.name].samples.empty()) << e.name << ": a CPU job has no GPU series";
  }
  runtime::DeviceStepStats st;
  st.device = "NVIDIA H200 (cuda:0)";
  st.memory_in_use_bytes = 3 << 20;
  st.memory_peak_bytes = 5 << 20;
  st.memory_reserved_bytes = 8 << 20;
  st.memory_total_bytes = int64_t{141} << 30;
  st.phase_ms = {4.0, 2.5, 1.0, 0.5, 0.25, 0.125};
  ranks[0]->OnDeviceStep(st);
  got = metrics::ScrapeMetrics((*ex)->port());
  ExpectSeries(got, WorkerGpuSeries());
  ExpectNaming(got);
  EXPECT_EQ(got["rackrun_gpu_memory_in_use_bytes"].samples.at(0).value, 3 << 20);
  EXPECT_EQ(got["rackrun_gpu_memory_peak_bytes"].samples.at(0).value, 5 << 20);
  EXPECT_EQ(got["rackrun_gpu_memory_reserved_bytes"].samples.at(0).value, 8 << 20);
  EXPECT_EQ(got["rackrun_gpu_memory_total_bytes"].samples.at(0).value,
            static_cast<double>(int64_t{141} << 30));
  std::map<std::string, double> phase_s;
  for (const Sample& s : got["rackrun_gpu_step_device_seconds"].samples) {
    EXPECT_EQ(s.labels.at("job_id"), "j-9");
    phase_s[s.labels.at("phase")] = s.value;
  }
  const std::map<std::string, double> want = {{"gemm", 4e-3},        {"attention", 2.5e-3},
                                              {"streams", 1e-3},     {"routing", 5e-4},
                                              {"optimizer", 2.5e-4}, {"other", 1.25e-4}};
  ASSERT_EQ(phase_s.size(), want.size());
  for (const auto& [phase, seconds] : want) EXPECT_NEAR(phase_s[phase], seconds, 1e-12) << phase;
  // The next step's figures replace the last's.
  st.memory_in_use_bytes = 4 << 20;
  ranks[0]->OnDeviceStep(st);
  got = metrics::ScrapeMetrics((*ex)->port());
  EXPECT_EQ(got["rackrun_gpu_memory_in_use_bytes"].samples.size(), 1u);
  EXPECT_EQ(got["rackrun_gpu_memory_in_use_bytes"].samples.at(0).value, 4 << 20);
  ranks.clear();
  got = metrics::ScrapeMetrics((*ex)->port());
  for (const ExpectedSeries& e : WorkerGpuSeries()) {
    EXPECT_TRUE(got[e.name].samples.empty()) << e.name << " outlived its job";
  }
}

TEST(TrainingMetricsTest, ModelFlopsCountActiveParameters) {
  rackrun::v1::JobSpec spec;
  spec.mutable_model()->set_width(64);
  spec.mutable_model()->set_blocks(2);
  spec.mutable_model()->mutable_moe()->set_experts(8);
  spec.mutable_model()->mutable_moe()->set_top_k(2);
  // 2 blocks x 6 idle experts x 3 x 64 x 128 parameters a token never touches.
  const double inactive = 2.0 * 6 * 3 * 64 * 128;
  EXPECT_DOUBLE_EQ(ModelFlopsPerToken(spec, 1000000), 6 * (1000000 - inactive));
}

}  // namespace
}  // namespace rackrun::worker
