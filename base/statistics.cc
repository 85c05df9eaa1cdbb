#include "base/statistics.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace rackrun::base {

double Mean(const std::vector<double>& samples) {
  if (samples.empty()) return 0;
  double sum = 0;
  for (const double x : samples) sum += x;
  return sum / static_cast<double>(samples.size());
}

double Median(std::vector<double> samples) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  return n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
}

double Percentile(std::vector<double> samples, double q) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const double rank = std::ceil(std::clamp(q, 0.0, 1.0) * static_cast<double>(samples.size()));
  const auto k = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(samples.size())));
  return samples[k - 1];
}

double MaxOverMean(const std::vector<double>& values) {
  double max = 0, sum = 0;
  for (const double x : values) {
    max = std::max(max, x);
    sum += x;
  }
  if (values.empty() || sum <= 0) return 0;
  return max / (sum / static_cast<double>(values.size()));
}

}  // namespace rackrun::base
