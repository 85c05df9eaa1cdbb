// The dashboard's HTTP server on 127.0.0.1 with a fake source: routes, JSON views, and
// bad requests (garbage, oversized, wrong method, traversal, idle clients) that must get
// an error or a closed connection, never a crash or a hang.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "metrics/dashboard.h"
#include "metrics/scrape.h"

namespace rackrun::metrics {
namespace {

class FakeSource : public DashboardSource {
 public:
  absl::StatusOr<rackrun::v1::ListJobsResponse> ListJobs() override {
    rackrun::v1::ListJobsResponse r;
    rackrun::v1::Job* j = r.add_jobs();
    j->set_id("j-1");
    j->set_state(rackrun::v1::RUNNING);
    return r;
  }
  absl::StatusOr<rackrun::v1::Job> GetJob(const std::string& id) override {
    if (id != "j-1") return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
    rackrun::v1::Job j;
    j.set_id(id);
    return j;
  }
  absl::Status Events(const std::string& id, int64_t after, std::vector<rackrun::v1::JobEvent>* out,
                      bool* done) override {
    if (id != "j-1") return absl::NotFoundError("no such job");
    for (int64_t seq = after + 1; seq <= 1500; ++seq) {
      rackrun::v1::JobEvent e;
      e.set_seq(seq);
      e.set_job_id(id);
      rackrun::v1::StepProgress* p = e.mutable_progress();
      p->set_step(seq);
      p->set_loss(1.0 / static_cast<double>(seq));
      rackrun::v1::ExpertLoadSample* s = p->add_expert_loads();
      s->set_layer(0);
      s->add_tokens(3);
      out->push_back(e);
    }
    *done = true;
    return absl::OkStatus();
  }
  rackrun::v1::ListWorkersResponse ListWorkers() override { return {}; }
};

class DashboardTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("rackrun-dash-", getpid());
    for (const auto& [path, file] : DashboardAssets()) {
      std::filesystem::create_directories((dir_ / file).parent_path());
      std::ofstream(dir_ / file) << "asset " << file << "\n";
    }
    absl::StatusOr<std::unique_ptr<Dashboard>> d =
        Dashboard::Start({"127.0.0.1:0", dir_.string(), false}, &source_);
    ASSERT_TRUE(d.ok()) << d.status();
    dashboard_ = *std::move(d);
  }
  void TearDown() override {
    dashboard_.reset();
    std::filesystem::remove_all(dir_);
  }
  RawHttpResponse Get(const std::string& path) {
    absl::StatusOr<RawHttpResponse> r = HttpGet(dashboard_->port(), path);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : RawHttpResponse{};
  }

  std::filesystem::path dir_;
  FakeSource source_;
  std::unique_ptr<Dashboard> dashboard_;
};

TEST_F(DashboardTest, ServesPageAssetsAndJson) {
  RawHttpResponse r = Get("/");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "asset index.html\n");
  EXPECT_TRUE(absl::StrContains(r.headers, "text/html"));
  EXPECT_TRUE(absl::StrContains(r.headers, "Content-Security-Policy: default-src 'self'"));
  EXPECT_EQ(Get("/static/uPlot.iife.min.js").body,
            "asset node_modules/uplot/dist/uPlot.iife.min.js\n");
  r = Get("/api/jobs");
  EXPECT_EQ(r.status, 200);
  EXPECT_TRUE(absl::StrContains(r.body, "\"state\":\"RUNNING\"")) << r.body;
  EXPECT_EQ(Get("/api/jobs/j-1").status, 200);
  EXPECT_EQ(Get("/api/jobs/j-2").status, 404);
  r = Get("/api/jobs/j-1/events?after=10");
  EXPECT_EQ(r.status, 200);
  EXPECT_TRUE(absl::StrContains(r.body, "\"expert_loads\":")) << r.body.substr(0, 300);
  EXPECT_TRUE(absl::StrContains(r.body, "\"done\": false, \"next\": 1010"))
      << "capped at 1000 events";
  r = Get("/api/jobs/j-1/events?after=1010");
  EXPECT_TRUE(absl::StrContains(r.body, "\"done\": true, \"next\": 1500"));
  EXPECT_EQ(Get("/api/jobs/j-1/events?after=-3").status, 400);
  EXPECT_EQ(Get("/api/jobs/j-1/events?after=x").status, 400);
  EXPECT_EQ(Get("/api/workers").status, 200);
  EXPECT_EQ(Get("/healthz").body, "ok\n");
}

TEST_F(DashboardTest, RefusesWhatItDoesNotServe) {
  EXPECT_EQ(Get("/static/../../etc/passwd").status, 404);
  EXPECT_EQ(Get("/static/%2e%2e/%2e%2e/etc/passwd").status, 404);
  EXPECT_EQ(Get("/api/jobs/..%2f..%2fetc").status, 404);
  EXPECT_EQ(Get("/nope").status, 404);
  absl::StatusOr<RawHttpResponse> post =
      RawHttp(dashboard_->port(), "POST /api/jobs HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}");
  ASSERT_TRUE(post.ok());
  EXPECT_EQ(post->status, 405);
  absl::StatusOr<RawHttpResponse> del =
      RawHttp(dashboard_->port(), "DELETE /api/jobs/j-1 HTTP/1.1\r\nHost: x\r\n\r\n");
  ASSERT_TRUE(del.ok());
  EXPECT_EQ(del->status, 405);
}

TEST_F(DashboardTest, SurvivesBadRequests) {
  for (const std::string& bad :
       {std::string("garbage\r\n\r\n"), std::string("\x01\x02\x03\xff\r\n\r\n"),
        std::string("GET\r\n\r\n"), std::string("GET / HTTP/9.9\r\n\r\n"),
        std::string("GET / HTTP/1.1\r\nHost: x\r\n") + std::string(64 << 10, 'a'),
        std::string("GET /") + std::string(40000, 'b') + " HTTP/1.1\r\n\r\n",
        std::string("\r\n\r\n")}) {
    absl::StatusOr<RawHttpResponse> r = RawHttp(dashboard_->port(), bad, 15000);
    // An error status or a closed connection; never a hang (RawHttp's deadline) nor a 200.
    if (r.ok()) {
      EXPECT_NE(r->status, 200) << bad.substr(0, 40);
    }
    EXPECT_NE(r.status().code(), absl::StatusCode::kDeadlineExceeded) << bad.substr(0, 40);
  }
  // Idle connections that never send a byte do not block others.
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<RawHttpResponse> unused = RawHttp(dashboard_->port(), "", 200);
    (void)unused;
  }
  EXPECT_EQ(Get("/healthz").status, 200);
}

// A remote dashboard (the coordinator passes a token check): the page loads, its views need
// ?token= with a token the check accepts (the coordinator's: any role's).
TEST_F(DashboardTest, WithATokenCheckTheViewsNeedAToken) {
  absl::StatusOr<std::unique_ptr<Dashboard>> d =
      Dashboard::Start({"127.0.0.1:0", dir_.string(), true}, &source_,
                       [](const std::string& t) { return t == "ro"; });
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->Handle("/", "").status, 200);
  EXPECT_EQ((*d)->Handle("/healthz", "").status, 200);
  const HttpResponse none = (*d)->Handle("/api/workers", "");
  EXPECT_EQ(none.status, 401);
  EXPECT_TRUE(absl::StrContains(none.body, "token-readonly")) << none.body;
  EXPECT_EQ((*d)->Handle("/api/jobs", "token=wrong").status, 401);
  EXPECT_EQ((*d)->Handle("/api/jobs", "token=ro").status, 200);
  EXPECT_EQ((*d)->Handle("/api/jobs/j-1/events", "after=10&token=ro").status, 200);
  // Without a check (loopback), no token is asked.
  EXPECT_EQ(dashboard_->Handle("/api/workers", "").status, 200);
}

TEST(DashboardStart, RefusesRemoteAndMissingAssets) {
  FakeSource source;
  absl::StatusOr<std::unique_ptr<Dashboard>> d =
      Dashboard::Start({"0.0.0.0:0", "/nonexistent", false}, &source);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(d.status().message(), "loopback")) << d.status();
  d = Dashboard::Start({"127.0.0.1:0", "/nonexistent", false}, &source);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(d.status().message(), "tools/setup")) << d.status();
}

}  // namespace
}  // namespace rackrun::metrics
