#include "worker/connection.h"

#include "rpc/channel.h"

namespace rackrun::worker {

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::unique_ptr<Connection>> Connection::Create(const ConnectionOptions& options) {
  std::unique_ptr<Connection> c(new Connection());
  c->address_ = options.coordinator;
  c->call_timeout_ = options.call_timeout;
  rpc::CoordinatorChannelOptions channel_options;
  channel_options.ca_fetch_patience = options.ca_fetch_patience;
  absl::StatusOr<rpc::CoordinatorClientChannel> open = rpc::OpenCoordinatorChannel(
      c->address_, options.token_file, {options.tls_ca, options.tls_cert, options.tls_key}, channel_options);
  if (!open.ok()) return open.status();
  c->token_ = open->token.token;
  c->token_source_ = open->token.source;
  c->channel_ = open->channel;
  c->stub_ = rackrun::v1::RackControl::NewStub(c->channel_);
  return c;
}

std::unique_ptr<grpc::ClientContext> Connection::NewContext(
    std::chrono::milliseconds timeout) const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->AddMetadata("authorization", "Bearer " + token_);
  if (timeout.count() > 0) context->set_deadline(std::chrono::system_clock::now() + timeout);
  return context;
}

}  // namespace rackrun::worker
