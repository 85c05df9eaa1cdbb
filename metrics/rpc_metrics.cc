#include "metrics/rpc_metrics.h"

#include <grpcpp/support/status.h>

#include <chrono>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "metrics/buckets.h"

namespace rackrun::metrics {

namespace {

using grpc::experimental::InterceptionHookPoints;

class MetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(RpcMetrics* metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)), start_(std::chrono::steady_clock::now()) {}
  ~MetricsInterceptor() override {
    if (!recorded_) metrics_->Record(method_, grpc::StatusCode::CANCELLED, Seconds());
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) &&
        !recorded_) {
      recorded_ = true;
      metrics_->Record(method_, methods->GetSendStatus().error_code(), Seconds());
    }
    methods->Proceed();
  }

 private:
  double Seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  RpcMetrics* const metrics_;
  const std::string method_;
  const std::chrono::steady_clock::time_point start_;
  bool recorded_ = false;
};

class MetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MetricsInterceptorFactory(RpcMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new MetricsInterceptor(metrics_, info->method() != nullptr ? info->method() : "");
  }

 private:
  RpcMetrics* const metrics_;
};

}  // namespace

RpcMetrics::RpcMetrics(prometheus::Registry& registry)
    : calls_(prometheus::BuildCounter()
                 .Name("rackrun_grpc_server_calls_total")
                 .Help("gRPC calls the server finished, by method and status code")
                 .Register(registry)),
      seconds_(prometheus::BuildHistogram()
                   .Name("rackrun_grpc_server_call_duration_seconds")
                   .Help("Seconds from a gRPC call's start to its status (streams: their "
                         "lifetime), by method and code")
                   .Register(registry)) {}

std::string RpcMetrics::ShortMethod(const std::string& full_method) {
  // "/package.Service/Method": keep "Service/Method".
  const size_t slash = full_method.rfind('/');
  if (slash == std::string::npos || slash == 0)
    return full_method.empty() ? "unknown" : full_method;
  std::string service =
      full_method.substr(full_method[0] == '/' ? 1 : 0, slash - (full_method[0] == '/' ? 1 : 0));
  if (const size_t dot = service.rfind('.'); dot != std::string::npos)
    service = service.substr(dot + 1);
  return absl::StrCat(service, "/", full_method.substr(slash + 1));
}

std::string RpcMetrics::CodeName(int code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  if (code >= 0 && code <= 16) return kNames[code];
  return absl::StrCat("CODE_", code);
}

void RpcMetrics::Record(const std::string& full_method, int code, double seconds) {
  std::string method = ShortMethod(full_method);
  {
    // Bounded label values whatever clients call: the first kMaxMethods names, then "other".
    std::lock_guard<std::mutex> lock(mu_);
    if (methods_.count(method) == 0) {
      if (methods_.size() >= kMaxMethods) {
        method = "other";
      } else {
        methods_.insert(method);
      }
    }
  }
  const prometheus::Labels labels = {{"method", method}, {"code", CodeName(code)}};
  calls_.Add(labels).Increment();
  seconds_.Add(labels, RpcSecondsBuckets()).Observe(seconds);
}

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
RpcMetrics::InterceptorFactories() {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> v;
  v.push_back(std::make_unique<MetricsInterceptorFactory>(this));
  return v;
}

}  // namespace rackrun::metrics
