#include "metrics/series_checks.h"

#include <gtest/gtest.h>

#include <set>

#include "absl/strings/match.h"

namespace rackrun::metrics {

std::map<std::string, MetricFamily> ScrapeMetrics(int port) {
  absl::StatusOr<RawHttpResponse> r = HttpGet(port, "/metrics");
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  EXPECT_EQ(r->status, 200);
  absl::StatusOr<std::map<std::string, MetricFamily>> f = ParseExposition(r->body);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *f : std::map<std::string, MetricFamily>{};
}

void ExpectSeries(const std::map<std::string, MetricFamily>& got,
                  const std::vector<ExpectedSeries>& want) {
  for (const ExpectedSeries& e : want) {
    SCOPED_TRACE(e.name);
    auto it = got.find(e.name);
    ASSERT_NE(it, got.end()) << "missing family";
    EXPECT_EQ(it->second.type, e.type);
    EXPECT_FALSE(it->second.help.empty());
    ASSERT_FALSE(it->second.samples.empty()) << "family without samples";
    for (const Sample& s : it->second.samples) {
      std::set<std::string> keys;
      for (const auto& [k, v] : s.labels) {
        if (k != "le") keys.insert(k);
        EXPECT_FALSE(v.empty()) << s.name << " label " << k;
      }
      EXPECT_EQ(keys, e.labels) << s.name;
      EXPECT_NE(s.labels.count("job"), 1u) << "job is Prometheus' target label; use job_id";
      EXPECT_EQ(s.labels.count("expert"), 0u);
    }
  }
}

void ExpectNaming(const std::map<std::string, MetricFamily>& got) {
  for (const auto& [name, f] : got) {
    EXPECT_EQ(name.rfind("rackrun_", 0), 0u) << name;
    EXPECT_EQ(f.type == "counter", absl::EndsWith(name, "_total")) << name;
    EXPECT_EQ(name.find("milli"), std::string::npos) << name << ": base units";
  }
}

}  // namespace rackrun::metrics
