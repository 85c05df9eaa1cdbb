// MetricsExporter: the one Prometheus endpoint of a process (`--metrics-listen HOST:PORT`),
// serving GET /metrics in the text exposition format from one prometheus::Registry that
// every metric set of the process registers into (CoordinatorMetrics, RpcMetrics,
// worker::TrainingMetrics). docs/design.md section 9.
//
// Metrics are read-only figures (counts, times, losses; no spec contents, paths or
// tokens), so the endpoint may listen on any address a Prometheus server can reach.
//
// The endpoint is served by one thread of its own (default 8 MiB stack), one connection at
// a time: a request line and headers of at most 8 KiB within 2 s, GET or HEAD of /metrics
// (anything else 404 or 405), then the connection closes. Not prometheus::Exposer: its
// civetweb threads get 100 KiB stacks (Debian's build), from which glibc also carves every
// thread's static TLS; in a worker, OpenBLAS alone takes 60 KiB of that, and scrapes
// overflowed the rest (metrics_series_test holds a process with big static TLS).
//
// Thread safety: registry() and the metrics in it are thread-safe; Start/destruction are
// not concurrent with anything else.
#ifndef RACKRUN_METRICS_EXPORTER_H_
#define RACKRUN_METRICS_EXPORTER_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace rackrun::metrics {

class MetricsExporter {
 public:
  // Listens on `listen` ("HOST:PORT"; port 0 = any free port, see port()). InvalidArgument
  // naming --metrics-listen for a malformed address, Unavailable when it cannot listen.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(const std::string& listen);
  ~MetricsExporter();

  prometheus::Registry& registry() { return *registry_; }
  int port() const { return port_; }

 private:
  MetricsExporter() = default;
  void Serve();
  void Handle(int fd);

  std::shared_ptr<prometheus::Registry> registry_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // a byte here ends Serve
  std::thread thread_;
  int port_ = 0;
};

// Splits "HOST:PORT" ("[::1]:PORT" for IPv6). InvalidArgument naming `flag` otherwise.
absl::Status SplitHostPort(const std::string& address, const std::string& flag, std::string* host,
                           int* port);
// 127.0.0.0/8, ::1 or localhost.
bool IsLoopbackHost(const std::string& host);

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_EXPORTER_H_
