#include "metrics/buckets.h"

namespace rackrun::metrics {

const std::vector<double>& StepSecondsBuckets() {
  static const std::vector<double> b = [] {
    std::vector<double> v;
    double x = 0.005;
    for (int i = 0; i < 15; ++i, x *= 2) v.push_back(x);
    return v;
  }();
  return b;
}

const std::vector<double>& BalancingSecondsBuckets() {
  static const std::vector<double> b = {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                                        1e-2, 2.5e-2, 5e-2, 0.1,  0.25,   0.5,  1,    2.5,    10};
  return b;
}

const std::vector<double>& ImbalanceBuckets() {
  static const std::vector<double> b = {1.0,  1.01, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5,
                                        1.75, 2,    2.5,  3,    4,   6,   8};
  return b;
}

const std::vector<double>& RpcSecondsBuckets() {
  static const std::vector<double> b = {1e-4,   2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                                        2.5e-2, 5e-2,   0.1,  0.25, 0.5,    1,    2.5,
                                        5,      10,     30,   60,   300};
  return b;
}

}  // namespace rackrun::metrics
