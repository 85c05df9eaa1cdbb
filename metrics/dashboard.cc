#include "metrics/dashboard.h"

#include <google/protobuf/util/json_util.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "metrics/exporter.h"

namespace rackrun::metrics {

namespace {

constexpr int kMaxEvents = 1000;

HttpResponse Json(std::string body) {
  return HttpResponse{200, "application/json", std::move(body)};
}

HttpResponse Error(int status, const std::string& message) {
  std::string quoted;
  for (const char c : message) {
    if (c == '"' || c == '\\') {
      quoted += '\\';
      quoted += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      quoted += ' ';
    } else {
      quoted += c;
    }
  }
  return HttpResponse{status, "application/json", absl::StrCat("{\"error\": \"", quoted, "\"}")};
}

int HttpStatusOf(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kInvalidArgument:
      return 400;
    default:
      return 503;
  }
}

std::string ToJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(m, &out, o).ok()) return "{}";
  return out;
}

std::string ContentType(const std::string& file) {
  if (absl::EndsWith(file, ".html")) return "text/html; charset=utf-8";
  if (absl::EndsWith(file, ".js")) return "text/javascript; charset=utf-8";
  if (absl::EndsWith(file, ".css")) return "text/css; charset=utf-8";
  return "application/octet-stream";
}

// Job ids are "j-<n>"-like: letters, digits, '-', '_', '.'; anything else is not a job.
bool PlausibleId(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  for (const char c : id) {
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'))
      return false;
  }
  return true;
}

}  // namespace

const std::vector<std::pair<std::string, std::string>>& DashboardAssets() {
  static const std::vector<std::pair<std::string, std::string>> a = {
      {"/", "index.html"},
      {"/static/format.js", "format.js"},
      {"/static/dashboard.js", "dashboard.js"},
      {"/static/dashboard.css", "dashboard.css"},
      {"/static/uPlot.iife.min.js", "node_modules/uplot/dist/uPlot.iife.min.js"},
      {"/static/uPlot.min.css", "node_modules/uplot/dist/uPlot.min.css"},
  };
  return a;
}

absl::StatusOr<std::unique_ptr<Dashboard>> Dashboard::Start(const Options& options,
                                                            DashboardSource* source,
                                                            TokenCheck token_ok) {
  std::string host;
  int port = 0;
  if (absl::Status s = SplitHostPort(options.listen, "--dashboard-listen", &host, &port); !s.ok())
    return s;
  if (!options.allow_remote && !IsLoopbackHost(host)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dashboard-listen: '", options.listen,
                     "' is not a loopback address; the dashboard shows job specs and hosts, so it "
                     "serves 127.0.0.1 or ::1 "
                     "only (reach it by ssh -L), or pass --dashboard-allow-remote (its views then "
                     "ask for a token)"));
  }
  std::unique_ptr<Dashboard> d(new Dashboard());
  d->source_ = source;
  d->token_ok_ = std::move(token_ok);
  for (const auto& [path, file] : DashboardAssets()) {
    const std::string full = absl::StrCat(options.assets_dir, "/", file);
    std::ifstream in(full, std::ios::binary);
    if (!in) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--dashboard-assets: cannot read '", full,
          "'; run tools/setup (it runs npm ci in metrics/dashboard) or point --dashboard-assets at "
          "a copy of metrics/dashboard"));
    }
    std::ostringstream body;
    body << in.rdbuf();
    d->static_[path] = HttpResponse{200, ContentType(file), body.str()};
  }
  Dashboard* self = d.get();
  absl::StatusOr<std::unique_ptr<HttpServer>> server =
      HttpServer::Start({.listen = options.listen, .flag = "--dashboard-listen"},
                        [self](const std::string& path, const std::string& query) {
                          return self->Handle(path, query);
                        });
  if (!server.ok()) return server.status();
  d->server_ = *std::move(server);
  return d;
}

HttpResponse Dashboard::Handle(const std::string& path, const std::string& query) {
  if (auto it = static_.find(path == "/index.html" ? "/" : path); it != static_.end())
    return it->second;
  if (path == "/healthz") return HttpResponse{200, "text/plain; charset=utf-8", "ok\n"};
  if (token_ok_ && absl::StartsWith(path, "/api/") &&
      !token_ok_(HttpServer::QueryValue(query, "token"))) {
    return Error(
        401,
        "this dashboard needs a token: open it as /?token=<the coordinator's token-readonly "
        "(any role's token works)>");
  }
  if (path == "/api/workers") return Json(ToJson(source_->ListWorkers()));
  if (path == "/api/jobs" || path == "/api/jobs/") {
    absl::StatusOr<rackrun::v1::ListJobsResponse> jobs = source_->ListJobs();
    if (!jobs.ok()) return Error(HttpStatusOf(jobs.status()), std::string(jobs.status().message()));
    return Json(ToJson(*jobs));
  }
  constexpr absl::string_view kJobs = "/api/jobs/";
  if (absl::StartsWith(path, kJobs)) {
    std::string rest = path.substr(kJobs.size());
    const bool events = absl::EndsWith(rest, "/events");
    if (events) rest.resize(rest.size() - std::string("/events").size());
    if (!PlausibleId(rest)) return Error(404, "no such job");
    if (!events) {
      absl::StatusOr<rackrun::v1::Job> job = source_->GetJob(rest);
      if (!job.ok()) return Error(HttpStatusOf(job.status()), std::string(job.status().message()));
      return Json(ToJson(*job));
    }
    int64_t after = 0;
    const std::string a = HttpServer::QueryValue(query, "after");
    if (!a.empty() && (!absl::SimpleAtoi(a, &after) || after < 0)) {
      return Error(400, "after: a non-negative event sequence number");
    }
    std::vector<rackrun::v1::JobEvent> out;
    bool done = false;
    if (absl::Status s = source_->Events(rest, after, &out, &done); !s.ok()) {
      return Error(HttpStatusOf(s), std::string(s.message()));
    }
    if (out.size() > static_cast<size_t>(kMaxEvents)) {
      out.resize(kMaxEvents);
      done = false;
    }
    int64_t next = after;
    std::string body = "{\"events\": [";
    for (size_t i = 0; i < out.size(); ++i) {
      if (i > 0) body += ",";
      body += ToJson(out[i]);
      next = out[i].seq();
    }
    absl::StrAppend(&body, "], \"done\": ", done ? "true" : "false", ", \"next\": ", next, "}");
    return Json(std::move(body));
  }
  return Error(404, "no such page");
}

}  // namespace rackrun::metrics
