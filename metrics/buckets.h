// Histogram bucket bounds shared by the metric sets (base unit: seconds; imbalance is a
// factor >= 1).
#ifndef RACKRUN_METRICS_BUCKETS_H_
#define RACKRUN_METRICS_BUCKETS_H_

#include <vector>

namespace rackrun::metrics {

// Optimizer steps: 5 ms .. 82 s, doubling.
const std::vector<double>& StepSecondsBuckets();
// Balancing work and plan solves: 10 us .. 10 s (a solve takes tens of microseconds).
const std::vector<double>& BalancingSecondsBuckets();
// Max / mean rank load: 1 .. 8.
const std::vector<double>& ImbalanceBuckets();
// gRPC calls: 100 us .. 5 min (streams last long; they are labelled by method).
const std::vector<double>& RpcSecondsBuckets();

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_BUCKETS_H_
