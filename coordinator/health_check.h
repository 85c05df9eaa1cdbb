// A client of the coordinator's grpc.health.v1.Health service (tests, benchmarks, scripts
// that wait for SERVING). Debian's gRPC ships no health stubs, so the request and the
// answer are encoded by hand: HealthCheckResponse is one varint field (1: status).
#ifndef RACKRUN_COORDINATOR_HEALTH_CHECK_H_
#define RACKRUN_COORDINATOR_HEALTH_CHECK_H_

#include <chrono>
#include <memory>

#include <grpcpp/channel.h>

namespace rackrun::coordinator {

// The overall health (service ""): 1 SERVING, 2 NOT_SERVING (HealthCheckResponse's
// ServingStatus values), 0 an answer that is neither, -1 no answer within `deadline`.
int CheckHealth(const std::shared_ptr<grpc::Channel>& channel, std::chrono::milliseconds deadline);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_HEALTH_CHECK_H_
