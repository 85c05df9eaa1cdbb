#include "metrics/exporter.h"

#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

namespace rackrun::metrics {

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(const std::string& listen) {
  std::unique_ptr<MetricsExporter> e(new MetricsExporter());
  e->registry_ = std::make_shared<prometheus::Registry>();
  std::shared_ptr<prometheus::Registry> registry = e->registry_;
  HttpServer::Options options;
  options.listen = listen;
  options.flag = "--metrics-listen";
  options.max_connections = 64;
  options.request_timeout_ms = 2000;
  options.max_request_bytes = 8 << 10;
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, [registry](
                                                                                      const std::
                                                                                          string&
                                                                                              path,
                                                                                      const std::
                                                                                          string&) {
    if (path != "/metrics") {
      return HttpResponse{404, "text/plain; charset=utf-8", "rackrun metrics are at /metrics\n"};
    }
    return HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8",
                        prometheus::TextSerializer().Serialize(registry->Collect())};
  });
  if (!server.ok()) return server.status();
  e->server_ = *std::move(server);
  return e;
}

MetricsExporter::~MetricsExporter() = default;

}  // namespace rackrun::metrics
