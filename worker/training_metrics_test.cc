// The worker's per-job series (TrainingMetrics) scraped from a real exporter and held
// against the metrics contract (metrics/expected_series.h), and the model FLOPs behind MFU.
#include "worker/training_metrics.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

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
using metrics::WorkerRank0Series;
using metrics::WorkerSeries;

TEST(TrainingMetricsTest, WorkerExportsItsSeries) {
  absl::StatusOr<std::unique_ptr<metrics::MetricsExporter>> ex = metrics::MetricsExporter::Start("127.0.0.1:0");
  ASSERT_TRUE(ex.ok()) << ex.status();
  std::vector<std::unique_ptr<TrainingMetrics>> ranks;
  for (int r = 0; r < 2; ++r) {
    TrainingMetrics::Options o;
    o.job_id = "j-3";
    o.rank = r;
    o.ranks = 2;
    o.flops_per_token = 6e6;
    o.peak_flops = 1e12;
    o.total_steps = 10;
    ranks.push_back(std::make_unique<TrainingMetrics>((*ex)->registry(), o));
    ranks.back()->SetPhase("forward_backward");
    ranks.back()->SetPhase("optimizer");
  }
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
  ExpectSeries(got, WorkerRank0Series());
  ExpectNaming(got);
  for (const Sample& s : got["rackrun_train_tokens_total"].samples) EXPECT_EQ(s.value, 1500);  // 3 x 1000 / 2
  for (const Sample& s : got["rackrun_train_mfu_ratio"].samples) {
    EXPECT_NEAR(s.value, 6e6 * 500 / 0.25 / 1e12, 1e-9);
    EXPECT_GT(s.value, 0);
    EXPECT_LE(s.value, 1);
  }
  EXPECT_EQ(got["rackrun_moe_last_imbalance_before"].samples.size(), 2u) << "rank 0 only, one per layer";
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
