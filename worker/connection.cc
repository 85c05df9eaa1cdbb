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
      c->address_, options.token_file, {options.tls_ca, options.tls_cert, options.tls_key},
      channel_options);
  if (!open.ok()) return open.status();
  c->token_ = open->token.token;
  c->token_source_ = open->token.source;
  c->credentials_ = open->credentials;
  std::lock_guard<std::mutex> lock(c->mu_);
  c->stub_ = rackrun::v1::RackControl::NewStub(open->channel);
  return c;
}

std::unique_ptr<grpc::ClientContext> Connection::NewContext(
    std::chrono::milliseconds timeout) const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->AddMetadata("authorization", "Bearer " + token_);
  if (timeout.count() > 0) context->set_deadline(std::chrono::system_clock::now() + timeout);
  return context;
}

std::shared_ptr<Connection::Stub> Connection::stub() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stub_;
}

std::shared_ptr<Connection::Stub> Connection::stream_stub() {
  std::lock_guard<std::mutex> lock(mu_);
  if (stream_stub_ == nullptr) stream_stub_ = NewChannel();
  return stream_stub_;
}

std::shared_ptr<Connection::Stub> Connection::NewChannel() {
  rpc::CoordinatorChannelOptions o;
  o.generation = ++generation_;
  o.liveness = liveness_;
  return rackrun::v1::RackControl::NewStub(rpc::CoordinatorChannel(address_, credentials_, o));
}

bool Connection::Renew(const std::shared_ptr<Stub>& stub) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stub != nullptr && stub == stream_stub_) {
    stream_stub_.reset();  // the next stream_stub() makes a new one
    return true;
  }
  if (stub != stub_) return false;
  stub_ = NewChannel();
  return true;
}

void Connection::SetLiveness(std::chrono::milliseconds interval,
                             std::chrono::milliseconds timeout) {
  const rpc::LivenessTimings t = rpc::LivenessFor(interval, timeout);
  std::lock_guard<std::mutex> lock(mu_);
  if (liveness_.has_value() && liveness_->interval == t.interval &&
      liveness_->timeout == t.timeout) {
    return;
  }
  liveness_ = t;
  stub_ = NewChannel();
  stream_stub_.reset();  // the next stream gets a channel with these timings
}

rpc::LivenessTimings Connection::liveness() const {
  std::lock_guard<std::mutex> lock(mu_);
  return liveness_.value_or(
      rpc::LivenessFor(std::chrono::milliseconds(1000), std::chrono::milliseconds(5000)));
}

}  // namespace rackrun::worker
