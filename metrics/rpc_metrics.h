// RpcMetrics: gRPC server calls by method and status code, and their latency, recorded by
// a server interceptor so the handlers stay as they are:
//   rackrun_grpc_server_calls_total{method, code}            counter
//   rackrun_grpc_server_call_duration_seconds{method, code}  histogram (streams: their lifetime)
// method is "Service/Method" without the package ("JobService/Submit"); code is the
// canonical name ("OK", "UNAUTHENTICATED", ...). A call whose status was never sent (the
// client went away first) counts as CANCELLED.
//
// Usage: builder.experimental().SetInterceptorCreators(rpc_metrics.InterceptorFactories()).
// The RpcMetrics object must outlive the server.
//
// Thread safety: thread-safe.
#ifndef RACKRUN_METRICS_RPC_METRICS_H_
#define RACKRUN_METRICS_RPC_METRICS_H_

#include <grpcpp/support/server_interceptor.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace rackrun::metrics {

class RpcMetrics {
 public:
  explicit RpcMetrics(prometheus::Registry& registry);

  void Record(const std::string& full_method, int code, double seconds);

  // One factory for ServerBuilder::experimental().SetInterceptorCreators.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
  InterceptorFactories();

  // "/rackrun.v1.JobService/Submit" -> "JobService/Submit".
  static std::string ShortMethod(const std::string& full_method);
  // 16 -> "UNAUTHENTICATED".
  static std::string CodeName(int code);

 private:
  static constexpr size_t kMaxMethods = 64;
  prometheus::Family<prometheus::Counter>& calls_;
  prometheus::Family<prometheus::Histogram>& seconds_;
  std::mutex mu_;
  std::set<std::string> methods_;  // guarded by mu_
};

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_RPC_METRICS_H_
