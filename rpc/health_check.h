// A client of the grpc.health.v1.Health service the coordinator serves (tests, benchmarks,
// scripts that wait for SERVING): a gRPC party's client, so it lives with what every party
// shares, not in the coordinator. Debian's gRPC ships no health stubs, so the request and the
// answer are encoded by hand: HealthCheckResponse is one varint field (1: status).
#ifndef RACKRUN_RPC_HEALTH_CHECK_H_
#define RACKRUN_RPC_HEALTH_CHECK_H_

#include <grpcpp/channel.h>

#include <chrono>
#include <memory>

namespace rackrun::rpc {

// The overall health (service ""): 1 SERVING, 2 NOT_SERVING (HealthCheckResponse's
// ServingStatus values), 0 an answer that is neither, -1 no answer within `deadline`.
int CheckHealth(const std::shared_ptr<grpc::Channel>& channel, std::chrono::milliseconds deadline);

}  // namespace rackrun::rpc

#endif  // RACKRUN_RPC_HEALTH_CHECK_H_
