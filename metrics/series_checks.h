// Test support (GoogleTest): a scrape of a real exporter held against the metrics contract
// (expected_series.h). Used by the metrics module's tests and by the worker's
// (worker/training_metrics_test.cc), whose series are part of the same contract.
#ifndef RACKRUN_METRICS_SERIES_CHECKS_H_
#define RACKRUN_METRICS_SERIES_CHECKS_H_

#include <map>
#include <string>
#include <vector>

#include "metrics/expected_series.h"
#include "metrics/scrape.h"

namespace rackrun::metrics {

// GET /metrics from 127.0.0.1:port, parsed; a failed scrape is a test failure and an
// empty map.
std::map<std::string, MetricFamily> ScrapeMetrics(int port);

// Every family of `want` is in `got` with its type, a help text and samples whose label
// keys are exactly the expected ones (none empty, never `job` or `expert`).
void ExpectSeries(const std::map<std::string, MetricFamily>& got,
                  const std::vector<ExpectedSeries>& want);

// Every family is rackrun_-prefixed, counters and only counters end in _total, and
// values are in base units (no "milli").
void ExpectNaming(const std::map<std::string, MetricFamily>& got);

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_SERIES_CHECKS_H_
