// Test support: a blocking loopback HTTP/1.0 client and a parser of Prometheus' text
// exposition format (version 0.0.4), for tests that scrape real endpoints.
#ifndef RACKRUN_METRICS_SCRAPE_H_
#define RACKRUN_METRICS_SCRAPE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace rackrun::metrics {

struct RawHttpResponse {
  int status = 0;
  std::string headers;
  std::string body;
};

// A blocking TCP connection to 127.0.0.1:port that has sent nothing; -1 if it cannot connect.
int ConnectLoopback(int port);
// Sends `request` bytes to 127.0.0.1:port and reads until the server closes, within
// timeout_ms. Unavailable when it cannot connect, DeadlineExceeded on timeout.
absl::StatusOr<RawHttpResponse> RawHttp(int port, const std::string& request,
                                        int timeout_ms = 5000);
// GET path (with query) from 127.0.0.1:port.
absl::StatusOr<RawHttpResponse> HttpGet(int port, const std::string& path, int timeout_ms = 5000);

struct Sample {
  std::string name;  // with suffix (_bucket, _sum, _count)
  std::map<std::string, std::string> labels;
  double value = 0;
};
struct MetricFamily {
  std::string type;  // counter | gauge | histogram | summary | untyped
  std::string help;
  std::vector<Sample> samples;
};

// name -> family. InvalidArgument naming the line for malformed input.
absl::StatusOr<std::map<std::string, MetricFamily>> ParseExposition(const std::string& text);

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_SCRAPE_H_
