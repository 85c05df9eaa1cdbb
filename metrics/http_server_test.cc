// The HTTP server under the dashboard and the metrics endpoint on 127.0.0.1: the request
// line, and clients that must not hold up others (idle connections by the hundred, one past
// the connection limit, a request a byte at a time, a client that never reads); then the
// dashboard with a fake source: routes, JSON views, and bad requests (garbage, oversized,
// wrong method, traversal, idle clients) that must get an error or a closed connection,
// never a crash or a hang.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "metrics/dashboard.h"
#include "metrics/scrape.h"

namespace rackrun::metrics {
namespace {

// Whether the server closed `fd` within timeout_ms (a read sees the end, after any bytes).
bool ClosedWithin(int fd, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  char buf[4096];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left < 0 ? 0 : left)) <= 0) return false;
    if (recv(fd, buf, sizeof(buf), 0) <= 0) return true;
  }
}

absl::StatusOr<std::unique_ptr<HttpServer>> EchoServer(HttpServer::Options options) {
  options.listen = "127.0.0.1:0";
  options.flag = "--test-listen";
  return HttpServer::Start(options, [](const std::string& path, const std::string& query) {
    if (path == "/big") return HttpResponse{200, "text/plain", std::string(32 << 20, 'b')};
    return HttpResponse{200, "text/plain", absl::StrCat("path=", path, " query=", query)};
  });
}

TEST(HttpServerTest, ReadsTheRequestLine) {
  absl::StatusOr<std::unique_ptr<HttpServer>> s = EchoServer({});
  ASSERT_TRUE(s.ok()) << s.status();
  const int port = (*s)->port();
  EXPECT_EQ(HttpGet(port, "/a%20b%2Fc?x=%20&y")->body, "path=/a b/c query=x=%20&y");
  EXPECT_EQ(RawHttp(port, "GET http://127.0.0.1:9/p?q HTTP/1.1\r\n\r\n")->body, "path=/p query=q");
  EXPECT_EQ(RawHttp(port, "GET /lf HTTP/1.0\n\n")->body, "path=/lf query=");
  absl::StatusOr<RawHttpResponse> head = RawHttp(port, "HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(head->status, 200);
  EXPECT_TRUE(absl::StrContains(head->headers, "Content-Length: 14")) << head->headers;
  EXPECT_TRUE(head->body.empty());
  for (const char* bad : {"GET / HTTP/2.0\r\n\r\n", "GET /\r\n\r\n", "GET * HTTP/1.1\r\n\r\n",
                          "\r\n\r\n", "GET  HTTP/1.1\r\n\r\n"}) {
    EXPECT_EQ(RawHttp(port, bad)->status, 400) << bad;
  }
  // A body the server never reads still lets the client read the answer.
  absl::StatusOr<RawHttpResponse> post = RawHttp(
      port, "POST /p HTTP/1.1\r\nContent-Length: 100000\r\n\r\n" + std::string(100000, 'x'));
  ASSERT_TRUE(post.ok()) << post.status();
  EXPECT_EQ(post->status, 405);
  EXPECT_EQ(HttpServer::PercentDecode("%41%4a%zz%4"), "AJ%zz%4");
}

// A hundred connections that never send a byte (each would hold a thread of a
// thread-per-connection server for its whole request timeout) do not delay a request.
TEST(HttpServerTest, IdleConnectionsDoNotHoldUpOthers) {
  absl::StatusOr<std::unique_ptr<HttpServer>> s = EchoServer({});  // 10 s to send a request
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<int> idle;
  for (int i = 0; i < 100; ++i) idle.push_back(ConnectLoopback((*s)->port()));
  absl::StatusOr<RawHttpResponse> r = HttpGet((*s)->port(), "/x", 3000);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  // The hundred stay open (the answered one closes once its client has read and gone).
  for (int i = 0; i < 100 && (*s)->open_connections() > 100; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ((*s)->open_connections(), 100);
  for (int fd : idle) close(fd);
}

// At the limit one more connection closes the one that has waited longest for its request.
TEST(HttpServerTest, AtTheConnectionLimitTheLongestWaitingGoes) {
  HttpServer::Options options;
  options.max_connections = 4;
  absl::StatusOr<std::unique_ptr<HttpServer>> s = EchoServer(options);
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<int> idle;
  for (int i = 0; i < 6; ++i) idle.push_back(ConnectLoopback((*s)->port()));
  absl::StatusOr<RawHttpResponse> r = HttpGet((*s)->port(), "/x", 3000);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(ClosedWithin(idle[i], 2000)) << "connection " << i;
  for (int i = 3; i < 6; ++i) EXPECT_FALSE(ClosedWithin(idle[i], 0)) << "connection " << i;
  for (int fd : idle) close(fd);
}

// A request a byte at a time is answered; one whose headers do not arrive in time gets 408;
// a client that never reads a 32 MiB response neither holds up others nor stays open.
TEST(HttpServerTest, SlowClientsCostOnlyTheirOwnConnection) {
  HttpServer::Options options;
  options.request_timeout_ms = 1500;
  options.response_timeout_ms = 1000;
  absl::StatusOr<std::unique_ptr<HttpServer>> s = EchoServer(options);
  ASSERT_TRUE(s.ok()) << s.status();
  const int port = (*s)->port();
  const int slow = ConnectLoopback(port), stalled = ConnectLoopback(port),
            greedy = ConnectLoopback(port);
  const std::string request = "GET /slow HTTP/1.1\r\n\r\n";
  for (char c : request) {
    ASSERT_EQ(send(slow, &c, 1, MSG_NOSIGNAL), 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(send(stalled, "GET / HT", 8, MSG_NOSIGNAL), 8);
  const std::string big = "GET /big HTTP/1.1\r\n\r\n";
  ASSERT_EQ(send(greedy, big.data(), big.size(), MSG_NOSIGNAL), static_cast<ssize_t>(big.size()));
  EXPECT_EQ(HttpGet(port, "/other", 3000)->status, 200);
  std::string answer;
  char buf[4096];
  for (ssize_t n; (n = recv(slow, buf, sizeof(buf), 0)) > 0;)
    answer.append(buf, static_cast<size_t>(n));
  EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200")) << answer;
  EXPECT_TRUE(absl::EndsWith(answer, "path=/slow query=")) << answer;
  answer.clear();
  for (ssize_t n; (n = recv(stalled, buf, sizeof(buf), 0)) > 0;)
    answer.append(buf, static_cast<size_t>(n));
  EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 408")) << answer;
  EXPECT_TRUE(ClosedWithin(greedy, 5000)) << "a response nobody reads is dropped";
  for (int fd : {slow, stalled, greedy}) close(fd);
  for (int i = 0; i < 50 && (*s)->open_connections() > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ((*s)->open_connections(), 0);
}

// Out of file descriptors, the server leaves its listener alone instead of spinning on it,
// and answers the waiting client once a descriptor is free.
TEST(HttpServerTest, OutOfDescriptorsItWaitsWithoutSpinning) {
  absl::StatusOr<std::unique_ptr<HttpServer>> s = EchoServer({});
  ASSERT_TRUE(s.ok()) << s.status();
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  const int client = socket(AF_INET, SOCK_STREAM, 0);  // made while descriptors are left
  ASSERT_GE(client, 0);
  // The limit caps descriptor numbers: at the lowest free one, none can be made.
  const int lowest_free = dup(client);
  ASSERT_GE(lowest_free, 0);
  close(lowest_free);
  rlimit full = before;
  full.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &full), 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>((*s)->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool connected = connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  const std::string request = "GET /full HTTP/1.1\r\n\r\n";
  if (connected) (void)send(client, request.data(), request.size(), MSG_NOSIGNAL);
  rusage r0{}, r1{};
  getrusage(RUSAGE_SELF, &r0);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  getrusage(RUSAGE_SELF, &r1);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
  ASSERT_TRUE(connected);
  const auto cpu = [](const rusage& r) {
    return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
           static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
  };
  EXPECT_LT(cpu(r1) - cpu(r0), 0.3) << "CPU seconds in one second without a free descriptor";
  std::string answer;
  char buf[4096];
  pollfd p{client, POLLIN, 0};
  while (poll(&p, 1, 3000) == 1) {
    const ssize_t n = recv(client, buf, sizeof(buf), 0);
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
  }
  EXPECT_TRUE(absl::EndsWith(answer, "path=/full query=")) << answer;
  close(client);
}

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
