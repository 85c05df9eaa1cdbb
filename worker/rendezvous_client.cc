#include "worker/rendezvous_client.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rackrun::worker {
namespace {

using Clock = std::chrono::steady_clock;

bool Retryable(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE ||
         s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

}  // namespace

grpc::Status RendezvousClient::Sliced(
    std::chrono::milliseconds total,
    const std::function<grpc::Status(Connection::Stub&, grpc::ClientContext*)>& call) {
  const auto end = Clock::now() + total;
  while (true) {
    const auto now = Clock::now();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - now);
    const std::chrono::milliseconds slice = std::max(
        std::chrono::milliseconds(1), std::min(left, connection_.liveness().heartbeat_deadline));
    const std::shared_ptr<Connection::Stub> stub = connection_.stub();
    std::unique_ptr<grpc::ClientContext> context = connection_.NewContext(slice);
    const grpc::Status s = call(*stub, context.get());
    if (s.ok() || !Retryable(s) || Clock::now() + std::chrono::milliseconds(1) >= end) return s;
    // Unavailable at once (no connection yet, the coordinator restarting): not faster than
    // the heartbeats renew the channel.
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
      std::this_thread::sleep_until(std::min(end, now + connection_.liveness().interval));
    }
  }
}

absl::Status RendezvousClient::Set(const std::string& key, const std::string& value) {
  rackrun::v1::StoreSetRequest request;
  request.set_job_id(job_id_);
  request.set_attempt(attempt_);
  request.set_store_id(store_id_);
  request.set_key(key);
  request.set_value(value);
  rackrun::v1::StoreSetResponse response;
  const grpc::Status s = Sliced(set_timeout_, [&](Connection::Stub& stub, grpc::ClientContext* c) {
    return stub.StoreSet(c, request, &response);
  });
  if (!s.ok()) {
    return absl::Status(FromGrpc(s).code(),
                        absl::StrCat("rendezvous: setting '", key, "': ", s.error_message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> RendezvousClient::Get(const std::vector<std::string>& keys,
                                                               absl::Duration timeout) {
  rackrun::v1::StoreGetRequest request;
  request.set_job_id(job_id_);
  request.set_attempt(attempt_);
  request.set_store_id(store_id_);
  for (const std::string& k : keys) request.add_keys(k);
  // No time to wait: ask whether they are there now (the coordinator answers at once), over
  // a slice or two, so that a loaded machine or a renewed connection's handshake is not
  // taken for missing keys.
  const bool now = timeout <= absl::ZeroDuration();
  request.set_no_wait(now);
  rackrun::v1::StoreGetResponse response;
  const auto ms =
      now ? 2 * connection_.liveness().heartbeat_deadline
          : std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  const grpc::Status s = Sliced(ms, [&](Connection::Stub& stub, grpc::ClientContext* c) {
    return stub.StoreGet(c, request, &response);
  });
  if (!s.ok()) {
    // A deadline from the client side carries no key names: name them here. Keys missing
    // now are a deadline passed, as the store's contract says.
    const absl::StatusCode code = s.error_code() == grpc::StatusCode::NOT_FOUND && now
                                      ? absl::StatusCode::kDeadlineExceeded
                                      : FromGrpc(s).code();
    return absl::Status(code, absl::StrCat("rendezvous: waiting for ", absl::StrJoin(keys, ", "),
                                           ": ", s.error_message()));
  }
  if (response.values_size() != static_cast<int>(keys.size())) {
    return absl::InternalError(absl::StrCat("rendezvous: asked for ", keys.size(),
                                            " keys, the coordinator returned ",
                                            response.values_size()));
  }
  return std::vector<std::string>(response.values().begin(), response.values().end());
}

}  // namespace rackrun::worker
