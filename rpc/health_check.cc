#include "rpc/health_check.h"

#include <grpcpp/client_context.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <future>
#include <string>
#include <vector>

namespace rackrun::rpc {

int CheckHealth(const std::shared_ptr<grpc::Channel>& channel, std::chrono::milliseconds deadline) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  grpc::Slice empty;  // HealthCheckRequest{service: ""} encodes to no bytes
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  if (!done.get_future().get().ok()) return -1;
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // Field 1, varint (tag byte 0x08), then a one-byte status.
  if (bytes.size() == 2 && bytes[0] == 0x08) return bytes[1];
  return 0;
}

}  // namespace rackrun::rpc
