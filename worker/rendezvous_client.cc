#include "worker/rendezvous_client.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rackrun::worker {

absl::Status RendezvousClient::Set(const std::string& key, const std::string& value) {
  rackrun::v1::StoreSetRequest request;
  request.set_job_id(job_id_);
  request.set_attempt(attempt_);
  request.set_key(key);
  request.set_value(value);
  rackrun::v1::StoreSetResponse response;
  std::unique_ptr<grpc::ClientContext> context = connection_.NewContext();
  const grpc::Status s = connection_.stub().StoreSet(context.get(), request, &response);
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
  for (const std::string& k : keys) request.add_keys(k);
  rackrun::v1::StoreGetResponse response;
  const auto ms = std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  std::unique_ptr<grpc::ClientContext> context = connection_.NewContext(ms);
  const grpc::Status s = connection_.stub().StoreGet(context.get(), request, &response);
  if (!s.ok()) {
    // A deadline from the client side carries no key names: name them here.
    const absl::StatusCode code = FromGrpc(s).code();
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
