// Dashboard: the coordinator's built-in live dashboard (the embedded default: one machine,
// no Grafana). A page (metrics/dashboard/index.html + dashboard.js, charts from uPlot
// installed by tools/setup from metrics/dashboard/package-lock.json) polls JSON views of
// the coordinator's in-memory state once a second and draws them without reloading:
//   GET /                              the page
//   GET /static/<file>                 its scripts and styles (a fixed list, read at start)
//   GET /api/jobs                      ListJobsResponse (newest first, up to 1000; the page
//                                      orders, filters and pages them itself)
//   GET /api/jobs/<id>                 Job (with attempts and last progress)
//   GET /api/jobs/<id>/events?after=N  {"events": [JobEvent...], "done": bool, "next": seq}
//                                      at most 1000 events per response; poll with next
//   GET /api/workers                   ListWorkersResponse (GONE ones included)
//   GET /healthz                       "ok"
// JSON is the proto3 JSON mapping with the proto field names (int64 as strings).
//
// Expert-level detail (the per-expert load heatmap) is StepProgress.expert_loads in the
// job's progress events: a sampled stream from the worker's rank 0 through the
// coordinator's job events, never Prometheus series.
//
// Security: read-only views (no call changes anything); the views show job specs (paths)
// and worker hosts, so Start refuses a non-loopback address unless allow_remote is set
// (--dashboard-allow-remote); reach a remote coordinator's dashboard by `ssh -L`. With a
// token check (the coordinator passes one for a remote dashboard), every /api/ view needs
// `?token=<token>` (the page, opened as /?token=..., passes its own on): a read-only
// credential.
//
// Thread safety: the source is called from the server's threads concurrently.
#ifndef RACKRUN_METRICS_DASHBOARD_H_
#define RACKRUN_METRICS_DASHBOARD_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "metrics/http_server.h"
#include "rackrun/v1/job_service.pb.h"

namespace rackrun::metrics {

// What the dashboard shows; the coordinator implements it over its Rack.
class DashboardSource {
 public:
  virtual ~DashboardSource() = default;
  virtual absl::StatusOr<rackrun::v1::ListJobsResponse> ListJobs() = 0;
  virtual absl::StatusOr<rackrun::v1::Job> GetJob(const std::string& job_id) = 0;
  // Events with seq > after_seq, without waiting; *done when the job's terminal state
  // event is among them or before. NotFound for an unknown job.
  virtual absl::Status Events(const std::string& job_id, int64_t after_seq,
                              std::vector<rackrun::v1::JobEvent>* out, bool* done) = 0;
  virtual rackrun::v1::ListWorkersResponse ListWorkers() = 0;
};

class Dashboard {
 public:
  struct Options {
    std::string listen;      // HOST:PORT
    std::string assets_dir;  // metrics/dashboard (with node_modules/uplot after tools/setup)
    bool allow_remote = false;
  };
  // Whether a token given as ?token= may read; empty: no token asked.
  using TokenCheck = std::function<bool(const std::string& token)>;
  // InvalidArgument naming the flag for a non-loopback address without allow_remote, or
  // missing assets (naming the file and tools/setup); Unavailable when it cannot listen.
  static absl::StatusOr<std::unique_ptr<Dashboard>> Start(const Options& options,
                                                          DashboardSource* source,
                                                          TokenCheck token_ok = {});

  int port() const { return server_->port(); }

  // The routing, without a network (tests).
  HttpResponse Handle(const std::string& path, const std::string& query);

 private:
  Dashboard() = default;
  DashboardSource* source_ = nullptr;
  TokenCheck token_ok_;
  std::map<std::string, HttpResponse> static_;  // by path
  std::unique_ptr<HttpServer> server_;
};

// The assets a Dashboard serves: URL path -> file under the assets folder.
const std::vector<std::pair<std::string, std::string>>& DashboardAssets();

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_DASHBOARD_H_
