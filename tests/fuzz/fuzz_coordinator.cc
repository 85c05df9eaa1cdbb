// Fuzz target: the coordinator's request handlers (coordinator/services.h), in process,
// against a real Rack on a fresh SQLite store in a scratch folder; no network. Input: a
// sequence of calls, each a method byte, a 2-byte little-endian length and that many bytes
// parsed as the method's request proto (bytes that do not parse are skipped, as gRPC would
// refuse them). Every call carries the right cluster token. After each call the Rack
// ticks. The unary methods of JobService and RackControl are covered; the streams
// (Watch, Assignments, Plans) need a live call object and are not.
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "coordinator/auth.h"
#include "coordinator/job_store.h"
#include "coordinator/rack.h"
#include "coordinator/services.h"
#include "grpcpp/test/server_context_test_spouse.h"
#include "tests/fuzz/fuzz_target.h"

namespace {

namespace co = ::rackrun::coordinator;
namespace v1 = ::rackrun::v1;

constexpr char kToken[] = "fuzz-token";

// Parses `bytes` as Request and calls `method` with a context that carries the token.
template <typename Request, typename Response, typename Service>
void Call(Service& service,
          grpc::Status (Service::*method)(grpc::ServerContext*, const Request*, Response*),
          const std::string& bytes) {
  Request request;
  if (!request.ParseFromString(bytes)) return;
  grpc::ServerContext context;
  grpc::testing::ServerContextTestSpouse spouse(&context);
  spouse.AddClientMetadata("authorization", std::string("Bearer ") + kToken);
  Response response;
  const grpc::Status status = (service.*method)(&context, &request, &response);
  // RACKRUN_FUZZ_VERBOSE=1: print each call's outcome (to check what a seed reaches).
  static const bool verbose = std::getenv("RACKRUN_FUZZ_VERBOSE") != nullptr;
  if (verbose) {
    std::fprintf(stderr, "%s -> %d %s\n", Request::descriptor()->name().c_str(),
                 static_cast<int>(status.error_code()), status.error_message().c_str());
  }
  if (status.ok()) {
    // A response is always serializable.
    std::string out;
    FUZZ_CHECK(response.SerializeToString(&out));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // In /dev/shm where there is one: the store fsyncs every commit, free on tmpfs.
  static const std::filesystem::path base =
      std::filesystem::is_directory("/dev/shm") ? std::filesystem::path("/dev/shm")
                                                : std::filesystem::temp_directory_path();
  const std::filesystem::path dir = base / ("rackrun-fuzz-coordinator-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    absl::StatusOr<std::unique_ptr<co::JobStore>> store =
        co::JobStore::Open((dir / "coordinator.db").string());
    FUZZ_CHECK(store.ok());
    int64_t now_ms = 1'700'000'000'000;
    co::Rack::Options options;
    options.channel_timeout_ms = 1;  // StoreGet waits at most this long
    co::Rack rack(store->get(), [&now_ms] { return now_ms; }, options);
    FUZZ_CHECK(rack.Initialize().ok());
    co::TokenAuth auth(kToken);
    co::ServingGate gate;
    gate.Open();
    co::JobServiceImpl jobs(&rack, &auth, &gate);
    co::RackControlImpl control(&rack, &auth, &gate);

    size_t pos = 0;
    int calls = 0;
    while (pos + 3 <= size && calls < 64) {
      const uint8_t method = data[pos];
      const size_t len = std::min<size_t>(data[pos + 1] | (size_t{data[pos + 2]} << 8), size - pos - 3);
      const std::string bytes(reinterpret_cast<const char*>(data + pos + 3), len);
      pos += 3 + len;
      ++calls;
      switch (method % 11) {
        case 0: Call(jobs, &co::JobServiceImpl::Submit, bytes); break;
        case 1: Call(jobs, &co::JobServiceImpl::Get, bytes); break;
        case 2: Call(jobs, &co::JobServiceImpl::List, bytes); break;
        case 3: Call(jobs, &co::JobServiceImpl::Cancel, bytes); break;
        case 4: Call(jobs, &co::JobServiceImpl::ListWorkers, bytes); break;
        case 5: Call(control, &co::RackControlImpl::Register, bytes); break;
        case 6: Call(control, &co::RackControlImpl::Heartbeat, bytes); break;
        case 7: Call(control, &co::RackControlImpl::Report, bytes); break;
        case 8: Call(control, &co::RackControlImpl::Deregister, bytes); break;
        case 9: Call(control, &co::RackControlImpl::StoreSet, bytes); break;
        case 10: Call(control, &co::RackControlImpl::StoreGet, bytes); break;
      }
      now_ms += 250;  // time passes between calls: heartbeats expire, jobs get scheduled
      rack.Tick();
    }
    rack.Shutdown();
  }
  std::filesystem::remove_all(dir);
  return 0;
}
