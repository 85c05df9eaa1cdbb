// HttpServer: a small read-only HTTP/1.1 server (civetweb underneath) for the dashboard.
// GET and HEAD only (anything else: 405); every request goes to one handler that maps a
// path and query to a complete response held in memory. civetweb bounds what a client can
// send (request line and headers at most 16 KiB, 10 s to send them, no keep-alive), so a
// bad or slow request costs one of `threads` workers for at most that long and never
// reaches the handler. Responses carry no-store caching and a same-origin content policy.
//
// civetweb's threads get 100 KiB stacks (Debian's build) minus the process's static TLS:
// fine in the coordinator, not in a process that links OpenBLAS (60 KiB of static TLS), so
// the workers' metrics endpoint is MetricsExporter's own thread instead.
//
// Thread safety: the handler is called concurrently from the server's threads.
#ifndef RACKRUN_METRICS_HTTP_SERVER_H_
#define RACKRUN_METRICS_HTTP_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

struct mg_context;
struct mg_connection;

namespace rackrun::metrics {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// path: the URL path, percent-decoded by civetweb ("/api/jobs/j-1"); query: the raw query
// string without '?' ("after=3"), empty when none.
using HttpHandler = std::function<HttpResponse(const std::string& path, const std::string& query)>;

class HttpServer {
 public:
  struct Options {
    std::string listen;                       // HOST:PORT, port 0 = any free port
    std::string flag = "--dashboard-listen";  // named in errors
    int threads = 4;
  };
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const Options& options,
                                                           HttpHandler handler);
  ~HttpServer();  // stops serving and waits for in-flight requests

  int port() const { return port_; }

  // "k=v&k2=v2": the value of `key`, or "" when absent.
  static std::string QueryValue(const std::string& query, const std::string& key);

 private:
  HttpServer() = default;
  static int Dispatch(::mg_connection* conn, void* self);

  HttpHandler handler_;
  mg_context* ctx_ = nullptr;
  int port_ = 0;
};

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_HTTP_SERVER_H_
