// Summary statistics of samples (timings, imbalances), one definition for every
// benchmark and report so their figures mean the same thing.
#ifndef RACKRUN_BASE_STATISTICS_H_
#define RACKRUN_BASE_STATISTICS_H_

#include <vector>

namespace rackrun::base {

// Arithmetic mean; 0 for no samples.
double Mean(const std::vector<double>& samples);

// Median (the mean of the two middle samples for an even count); 0 for no samples.
double Median(std::vector<double> samples);

// Nearest-rank percentile: the smallest sample with at least a fraction `q` (in [0, 1],
// clamped) of the samples at or below it; q = 0 gives the minimum. 0 for no samples.
double Percentile(std::vector<double> samples, double q);

// max / mean of non-negative values; 0 when the mean is 0 (nothing to balance).
double MaxOverMean(const std::vector<double>& values);

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_STATISTICS_H_
