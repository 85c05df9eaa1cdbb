// Scrapes real exporters over HTTP on 127.0.0.1 and checks that every expected series
// (expected_series.h) is there with its type and label keys, and nothing else.
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <array>
#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "metrics/coordinator_metrics.h"
#include "metrics/expected_series.h"
#include "metrics/exporter.h"
#include "metrics/rpc_metrics.h"
#include "metrics/scrape.h"
#include "metrics/series_checks.h"

namespace rackrun::metrics {
namespace {

// Static TLS as big as a worker's (OpenBLAS alone has 60 KiB): glibc carves it from every
// thread's stack, so the exporter must serve from a thread with a full-size stack.
thread_local std::array<char, 96 << 10> big_static_tls;

TEST(MetricsSeries, CoordinatorExportsItsSeries) {
  absl::StatusOr<std::unique_ptr<MetricsExporter>> ex = MetricsExporter::Start("127.0.0.1:0");
  ASSERT_TRUE(ex.ok()) << ex.status();
  ASSERT_GT((*ex)->port(), 0);
  CoordinatorMetrics cm((*ex)->registry());
  RpcMetrics rpc((*ex)->registry());
  rpc.Record("/rackrun.v1.JobService/Submit", 0, 0.002);
  rpc.Record("/rackrun.v1.JobService/Submit", 16, 0.001);
  std::map<std::string, MetricFamily> got = ScrapeMetrics((*ex)->port());
  ExpectSeries(got, CoordinatorSeries());
  ExpectNaming(got);
  for (const auto& name : {"rackrun_worker_heartbeat_age_seconds", "rackrun_job_progress_step"}) {
    EXPECT_TRUE(got[name].samples.empty()) << name << " before any worker or job";
  }
  bool unauthenticated = false;
  for (const Sample& s : got["rackrun_grpc_server_calls_total"].samples) {
    EXPECT_EQ(s.labels.at("method"), "JobService/Submit");
    if (s.labels.at("code") == "UNAUTHENTICATED") unauthenticated = s.value == 1;
  }
  EXPECT_TRUE(unauthenticated);

  // A snapshot with a running job and two workers, then one where both are gone.
  rackrun::v1::Job job;
  job.set_id("j-1");
  job.set_state(rackrun::v1::RUNNING);
  job.mutable_last_progress()->set_step(7);
  rackrun::v1::ListWorkersResponse workers;
  for (int r = 0; r < 2; ++r) {
    rackrun::v1::Worker* w = workers.add_workers();
    w->set_id(absl::StrCat("w-", r + 1));
    w->set_state(rackrun::v1::BUSY);
    w->set_job_id("j-1");
    w->set_rank(r);
    w->set_phase("forward_backward");
    w->set_heartbeat_age_s(0.25);
    w->set_step_time_s(0.5 + r);
  }
  cm.ObserveJobs({job});
  cm.ObserveWorkers(workers);
  cm.ObserveQueueWait(0.5);
  cm.ObserveFailure("worker_lost", true);
  cm.ObservePlanSolve("j-1", 0, 4e-5);
  cm.ObservePlanSolve("j-1", 1, 6e-5);
  cm.ObservePlanSolve("j-1", 1, 5e-5);
  got = ScrapeMetrics((*ex)->port());
  ExpectSeries(got, CoordinatorSeries());
  ExpectSeries(got, CoordinatorRunningSeries());
  ExpectSeries(got, CoordinatorPlanningSeries());
  ExpectNaming(got);
  std::map<std::string, double> solves;  // by domain: _count
  for (const Sample& s : got["rackrun_plan_solve_seconds"].samples) {
    if (absl::EndsWith(s.name, "_count")) solves[s.labels.at("domain")] = s.value;
  }
  EXPECT_EQ(solves, (std::map<std::string, double>{{"0", 1}, {"1", 2}})) << "one series per domain";
  for (const Sample& s : got["rackrun_jobs"].samples) {
    EXPECT_EQ(s.value, s.labels.at("state") == "running" ? 1 : 0) << s.labels.at("state");
  }
  EXPECT_EQ(got["rackrun_job_progress_step"].samples.at(0).value, 7);
  double straggler = 0;
  for (const Sample& s : got["rackrun_worker_step_seconds"].samples)
    straggler = std::max(straggler, s.value);
  EXPECT_EQ(straggler, 1.5);
  for (const Sample& s : got["rackrun_job_restarts_total"].samples) {
    EXPECT_EQ(s.value, s.labels.at("reason") == "worker_lost" ? 1 : 0);
  }
  EXPECT_EQ(got["rackrun_job_queue_wait_seconds"].samples.back().value, 1);  // _count

  job.set_state(rackrun::v1::SUCCEEDED);
  for (auto& w : *workers.mutable_workers()) w.set_state(rackrun::v1::GONE);
  cm.ObserveJobs({job});
  cm.ObserveWorkers(workers);
  got = ScrapeMetrics((*ex)->port());
  EXPECT_TRUE(got["rackrun_job_progress_step"].samples.empty());
  EXPECT_TRUE(got["rackrun_plan_solve_seconds"].samples.empty())
      << "every domain's series ends with the job";
  EXPECT_TRUE(got["rackrun_worker_step_seconds"].samples.empty());
  EXPECT_TRUE(got["rackrun_worker_heartbeat_age_seconds"].samples.empty());
  for (const Sample& s : got["rackrun_workers"].samples) {
    EXPECT_EQ(s.value, s.labels.at("state") == "gone" ? 2 : 0);
  }
}

TEST(MetricsSeries, RpcMethodLabelsStayBounded) {
  prometheus::Registry registry;
  RpcMetrics rpc(registry);
  for (int i = 0; i < 200; ++i) rpc.Record(absl::StrCat("/x.Svc/M", i), 12, 0.001);
  absl::StatusOr<std::unique_ptr<MetricsExporter>> ex = MetricsExporter::Start("127.0.0.1:0");
  ASSERT_TRUE(ex.ok());
  EXPECT_EQ(RpcMetrics::ShortMethod("/rackrun.v1.RackControl/Heartbeat"), "RackControl/Heartbeat");
  EXPECT_EQ(RpcMetrics::CodeName(14), "UNAVAILABLE");
  size_t series = 0;
  for (const auto& family : registry.Collect()) {
    if (family.name == "rackrun_grpc_server_calls_total") series = family.metric.size();
  }
  EXPECT_LE(series, 65u);
}

TEST(MetricsSeries, ExporterServesOnlyGetMetricsAndSurvivesBadRequests) {
  big_static_tls[0] = 1;
  absl::StatusOr<std::unique_ptr<MetricsExporter>> ex = MetricsExporter::Start("127.0.0.1:0");
  ASSERT_TRUE(ex.ok()) << ex.status();
  CoordinatorMetrics cm((*ex)->registry());
  const int port = (*ex)->port();
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<RawHttpResponse> r = HttpGet(port, "/metrics?x=1");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status, 200);
    EXPECT_TRUE(absl::StrContains(r->headers, "text/plain; version=0.0.4"));
    EXPECT_TRUE(absl::StrContains(r->body, "# TYPE rackrun_jobs gauge"));
  }
  EXPECT_EQ(HttpGet(port, "/")->status, 404);
  EXPECT_EQ(RawHttp(port, "POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n")->status, 405);
  absl::StatusOr<RawHttpResponse> head = RawHttp(port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(head->status, 200);
  EXPECT_TRUE(head->body.empty());
  for (const std::string& bad :
       {std::string("garbage\r\n\r\n"), std::string(20000, 'x'), std::string("\x01\xff\r\n\r\n"),
        std::string("GET /metrics\r\n\r\n")}) {
    absl::StatusOr<RawHttpResponse> r = RawHttp(port, bad, 10000);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status, 400) << bad.substr(0, 20);
  }
  // A client that connects and says nothing holds the endpoint for at most 2 s.
  absl::StatusOr<RawHttpResponse> idle = RawHttp(port, "", 5000);
  EXPECT_TRUE(idle.ok()) << idle.status();
  EXPECT_EQ(HttpGet(port, "/metrics")->status, 200);
}

TEST(MetricsSeries, ExporterRejectsBadAddresses) {
  EXPECT_EQ(MetricsExporter::Start("nonsense").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsExporter::Start("127.0.0.1:99999").status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<MetricsExporter>> a = MetricsExporter::Start("127.0.0.1:0");
  ASSERT_TRUE(a.ok());
  absl::StatusOr<std::unique_ptr<MetricsExporter>> b =
      MetricsExporter::Start(absl::StrCat("127.0.0.1:", (*a)->port()));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace rackrun::metrics
