// HttpServer: a small read-only HTTP/1.x server on one thread of its own, for the dashboard
// and the metrics endpoint (MetricsExporter). GET and HEAD only (anything else: 405); every
// request goes to one handler that maps a path and query to a complete response held in
// memory; one request per connection (Connection: close).
//
// Many connections at once, none able to hold up another: the thread polls every open
// connection (non-blocking sockets), so a client that connects and says nothing, sends its
// request a byte at a time, or never reads its response costs one slot and its buffers,
// not the server. Bounds a client cannot pass:
// - the request line and headers within `request_timeout_ms` and `max_request_bytes`
//   (else 408 or 400, then close); a body is never read;
// - the response read within `response_timeout_ms` (else the connection is dropped);
// - at most `max_connections` open: one more closes the connection that has waited longest
//   for its request to arrive, so a flood of idle connections cannot lock clients out;
// - out of file descriptors, the listener rests 100 ms between tries instead of spinning.
// Handlers run on the server thread, one at a time, so a handler must not block for long.
// Responses carry no-store caching and a same-origin content policy. The thread has the
// default stack (civetweb's 100 KiB threads, its predecessor here, overflowed in a worker,
// whose static TLS takes most of them).
//
// Thread safety: Start and destruction are not concurrent with anything else; the handler is
// called on the server thread only.
#ifndef RACKRUN_METRICS_HTTP_SERVER_H_
#define RACKRUN_METRICS_HTTP_SERVER_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rackrun::metrics {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// path: the URL path, percent-decoded ("/api/jobs/j-1"); query: the raw query string without
// '?' ("after=3"), empty when none.
using HttpHandler = std::function<HttpResponse(const std::string& path, const std::string& query)>;

class HttpServer {
 public:
  struct Options {
    std::string listen;                       // HOST:PORT, port 0 = any free port
    std::string flag = "--dashboard-listen";  // named in errors
    int max_connections = 256;
    int request_timeout_ms = 10000;
    size_t max_request_bytes = 16 << 10;
    int response_timeout_ms = 30000;
  };
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const Options& options,
                                                           HttpHandler handler);
  ~HttpServer();  // stops serving (open connections are closed) and joins the thread

  int port() const { return port_; }
  // Connections open now (for tests and probes).
  int open_connections() const { return open_.load(std::memory_order_relaxed); }

  // "k=v&k2=v2": the value of `key`, or "" when absent.
  static std::string QueryValue(const std::string& query, const std::string& key);
  // "/a%20b" -> "/a b" (no '+' conversion); a malformed escape is kept as it is.
  static std::string PercentDecode(const std::string& s);

 private:
  struct Connection;
  using Clock = std::chrono::steady_clock;
  HttpServer() = default;
  // The server thread's loop and its steps (conns_ is the thread's own).
  void Serve();
  void Expire(Clock::time_point now);
  void Accept(Clock::time_point now);
  void ReadSome(Connection& c);
  void WriteSome(Connection& c, Clock::time_point now);
  void StartWriting(Connection& c, std::string response);
  // The response to a complete request head (request line and headers).
  std::string Respond(const std::string& head);

  Options options_;
  HttpHandler handler_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // a byte here ends Serve
  std::thread thread_;
  int port_ = 0;
  std::atomic<int> open_{0};
  std::vector<std::unique_ptr<Connection>> conns_;  // in accept order
  Clock::time_point accept_paused_until_{};         // out of descriptors: the listener rests
};

// Splits "HOST:PORT" ("[::1]:PORT" for IPv6). InvalidArgument naming `flag` otherwise.
absl::Status SplitHostPort(const std::string& address, const std::string& flag, std::string* host,
                           int* port);
// 127.0.0.0/8, ::1 or localhost.
bool IsLoopbackHost(const std::string& host);

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_HTTP_SERVER_H_
