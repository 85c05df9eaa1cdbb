#include "metrics/exporter.h"

#include <exception>

#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rackrun::metrics {

absl::Status SplitHostPort(const std::string& address, const std::string& flag, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", address, "' is not HOST:PORT (e.g. 127.0.0.1:9464; port 0 = any free port)"));
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  if (!absl::SimpleAtoi(address.substr(colon + 1), port) || *port < 0 || *port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", address, "' has no port number in [0, 65535] after the last ':'"));
  }
  return absl::OkStatus();
}

bool IsLoopbackHost(const std::string& host) {
  return absl::StartsWith(host, "127.") || host == "::1" || host == "localhost";
}

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(const std::string& listen) {
  std::string host;
  int port = 0;
  if (absl::Status s = SplitHostPort(listen, "--metrics-listen", &host, &port); !s.ok()) return s;
  std::unique_ptr<MetricsExporter> e(new MetricsExporter());
  e->registry_ = std::make_shared<prometheus::Registry>();
  const std::string civet = host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                                                 : absl::StrCat(host, ":", port);
  try {
    e->exposer_ = std::make_unique<prometheus::Exposer>(civet, /*num_threads=*/2);
  } catch (const std::exception& ex) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot listen on ", listen, " (address in use, or not local): ", ex.what()));
  }
  e->exposer_->RegisterCollectable(e->registry_);
  const std::vector<int> ports = e->exposer_->GetListeningPorts();
  if (ports.empty()) return absl::UnavailableError(absl::StrCat("--metrics-listen: no port bound for ", listen));
  e->port_ = ports.front();
  return e;
}

MetricsExporter::~MetricsExporter() = default;

}  // namespace rackrun::metrics
