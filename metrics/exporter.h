// MetricsExporter: the one Prometheus endpoint of a process (`--metrics-listen HOST:PORT`),
// serving GET /metrics in the text exposition format from one prometheus::Registry that
// every metric set of the process registers into (CoordinatorMetrics, RpcMetrics,
// worker::TrainingMetrics). docs/design.md section 9.
//
// Metrics are read-only figures (counts, times, losses; no spec contents, paths or
// tokens), so the endpoint may listen on any address a Prometheus server can reach.
//
// The endpoint is an HttpServer (http_server.h: one thread of its own with the default
// stack, every connection polled at once): GET or HEAD of /metrics (anything else 404 or
// 405), a request line and headers of at most 8 KiB within 2 s, at most 64 connections
// open (one more closes the one waiting longest for its request), so idle or slow clients
// never hold up a scrape. Not prometheus::Exposer: its civetweb threads get 100 KiB stacks
// (Debian's build), from which glibc also carves every thread's static TLS; in a worker,
// OpenBLAS alone takes 60 KiB of that, and scrapes overflowed the rest (metrics_series_test
// holds a process with big static TLS).
//
// Thread safety: registry() and the metrics in it are thread-safe; Start/destruction are
// not concurrent with anything else.
#ifndef RACKRUN_METRICS_EXPORTER_H_
#define RACKRUN_METRICS_EXPORTER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "metrics/http_server.h"  // SplitHostPort, IsLoopbackHost for the processes' flags

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
  int port() const { return server_->port(); }

 private:
  MetricsExporter() = default;

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<HttpServer> server_;
};

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_EXPORTER_H_
