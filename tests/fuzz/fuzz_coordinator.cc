// Fuzz target: the coordinator's request handlers (coordinator/services.h), in process,
// against a real Rack on a fresh SQLite store in a scratch folder; no network. Input: a
// sequence of calls, each a method byte, a 2-byte little-endian length and that many bytes
// parsed as the method's request proto (bytes that do not parse are skipped, as gRPC would
// refuse them). Every call carries the right cluster token. After each call the Rack
// ticks. The unary methods of JobService and RackControl are called directly; the streams
// (Watch, Assignments, Plans) go through a real gRPC server with an in-process channel (no
// socket): Watch and Plans read until the stream ends or a 20 ms deadline passes (the
// handlers poll every 2 ms here); Assignments streams stay open, as a worker's does, until
// the input ends and the client cancels them. Every stream must end; the server survives.
// A Plans payload is a sequence of rows, each a 1-byte length and a LoadRow; at most 8
// stream calls per input.
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/auth.h"
#include "coordinator/job_store.h"
#include "coordinator/rack.h"
#include "coordinator/services.h"
#include "grpcpp/grpcpp.h"
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

// RACKRUN_FUZZ_VERBOSE=1: print a stream's outcome.
void Verbose(const char* name, int items, const grpc::Status& status) {
  static const bool verbose = std::getenv("RACKRUN_FUZZ_VERBOSE") != nullptr;
  if (verbose) {
    std::fprintf(stderr, "%s stream: %d messages -> %d %s\n", name, items,
                 static_cast<int>(status.error_code()), status.error_message().c_str());
  }
}

// The client side of a stream call: the token, and a deadline that ends streams that
// would otherwise wait for more (a job that does not finish, a worker's assignments).
void PrepareStreamContext(grpc::ClientContext* context) {
  context->AddMetadata("authorization", std::string("Bearer ") + kToken);
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(20));
}

void CallWatch(v1::JobService::Stub& stub, const std::string& bytes) {
  v1::WatchJobRequest request;
  if (!request.ParseFromString(bytes)) return;
  grpc::ClientContext context;
  PrepareStreamContext(&context);
  std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader = stub.Watch(&context, request);
  v1::JobEvent event;
  int64_t last = 0;
  int items = 0;
  while (reader->Read(&event)) {
    FUZZ_CHECK(event.seq() > last);  // events come in order, without repeats
    last = event.seq();
    ++items;
    if (std::getenv("RACKRUN_FUZZ_VERBOSE") != nullptr) {
      std::fprintf(stderr, "  event %s\n", event.ShortDebugString().c_str());
    }
  }
  Verbose("Watch", items, reader->Finish());
}

// An Assignments stream stays open (as a worker's does) until the input ends, so the rack
// can schedule onto its worker while later calls run; CloseAll ends them.
class OpenAssignments {
 public:
  void Open(v1::RackControl::Stub& stub, const std::string& bytes) {
    v1::AssignmentsRequest request;
    if (!request.ParseFromString(bytes)) return;
    Stream s;
    s.context = std::make_unique<grpc::ClientContext>();
    s.context->AddMetadata("authorization", std::string("Bearer ") + kToken);
    s.context->set_deadline(std::chrono::system_clock::now() +
                            std::chrono::seconds(5));  // a bound only
    s.reader = stub.Assignments(s.context.get(), request);
    // The handler sends its initial metadata once the stream is open in the rack (or ends
    // the call), so the calls after this one see the stream: replays are deterministic.
    s.reader->WaitForInitialMetadata();
    streams_.push_back(std::move(s));
  }
  void CloseAll() {
    for (Stream& s : streams_) {
      s.context->TryCancel();
      v1::Assignment assignment;
      int items = 0;
      while (s.reader->Read(&assignment)) ++items;
      Verbose("Assignments", items, s.reader->Finish());
    }
    streams_.clear();
  }

 private:
  struct Stream {
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientReader<v1::Assignment>> reader;
  };
  std::vector<Stream> streams_;
};

void CallPlans(v1::RackControl::Stub& stub, const std::string& bytes) {
  grpc::ClientContext context;
  PrepareStreamContext(&context);
  std::unique_ptr<grpc::ClientReaderWriter<v1::LoadRow, v1::PlanReply>> stream =
      stub.Plans(&context);
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t len = std::min<size_t>(static_cast<uint8_t>(bytes[pos]), bytes.size() - pos - 1);
    v1::LoadRow row;
    const bool parsed = row.ParseFromString(bytes.substr(pos + 1, len));
    pos += 1 + len;
    if (parsed && !stream->Write(row)) break;  // the server ended the stream
  }
  stream->WritesDone();
  v1::PlanReply reply;
  int items = 0;
  while (stream->Read(&reply)) ++items;
  Verbose("Plans", items, stream->Finish());
}

// Method `which` (0-13) with `bytes` as its request: the unary ones called directly, the
// streams (11-13) through the in-process server's stubs.
void CallMethod(int which, const std::string& bytes, co::JobServiceImpl& jobs,
                co::RackControlImpl& control, v1::JobService::Stub* job_stub,
                v1::RackControl::Stub* control_stub, OpenAssignments& assignments) {
  switch (which) {
    case 0:
      Call(jobs, &co::JobServiceImpl::Submit, bytes);
      break;
    case 1:
      Call(jobs, &co::JobServiceImpl::Get, bytes);
      break;
    case 2:
      Call(jobs, &co::JobServiceImpl::List, bytes);
      break;
    case 3:
      Call(jobs, &co::JobServiceImpl::Cancel, bytes);
      break;
    case 4:
      Call(jobs, &co::JobServiceImpl::ListWorkers, bytes);
      break;
    case 5:
      Call(control, &co::RackControlImpl::Register, bytes);
      break;
    case 6:
      Call(control, &co::RackControlImpl::Heartbeat, bytes);
      break;
    case 7:
      Call(control, &co::RackControlImpl::Report, bytes);
      break;
    case 8:
      Call(control, &co::RackControlImpl::Deregister, bytes);
      break;
    case 9:
      Call(control, &co::RackControlImpl::StoreSet, bytes);
      break;
    case 10:
      Call(control, &co::RackControlImpl::StoreGet, bytes);
      break;
    case 11:
      CallWatch(*job_stub, bytes);
      break;
    case 12:
      assignments.Open(*control_stub, bytes);
      break;
    case 13:
      CallPlans(*control_stub, bytes);
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // In /dev/shm where there is one: the store fsyncs every commit, free on tmpfs.
  static const std::filesystem::path base = std::filesystem::is_directory("/dev/shm")
                                                ? std::filesystem::path("/dev/shm")
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
    co::Rack rack(
        store->get(), [&now_ms] { return now_ms; }, options);
    FUZZ_CHECK(rack.Initialize().ok());
    co::TokenAuth auth(kToken);
    co::ServingGate gate;
    gate.Open();
    co::JobServiceImpl jobs(&rack, &auth, &gate, absl::Milliseconds(2));
    co::RackControlImpl control(&rack, &auth, &gate, absl::Milliseconds(2));
    // Started only when the input has a stream call (building a server costs milliseconds).
    std::unique_ptr<grpc::Server> server;
    std::unique_ptr<v1::JobService::Stub> job_stub;
    std::unique_ptr<v1::RackControl::Stub> control_stub;
    OpenAssignments assignments;
    int streams = 0;

    size_t pos = 0;
    int calls = 0;
    while (pos + 3 <= size && calls < 64) {
      const uint8_t method = data[pos];
      const size_t len =
          std::min<size_t>(data[pos + 1] | (size_t{data[pos + 2]} << 8), size - pos - 3);
      const std::string bytes(reinterpret_cast<const char*>(data + pos + 3), len);
      pos += 3 + len;
      ++calls;
      const int which = method % 14;
      if (which >= 11) {
        if (++streams > 8) continue;
        if (server == nullptr) {
          grpc::ServerBuilder builder;
          builder.RegisterService(&jobs);
          builder.RegisterService(&control);
          server = builder.BuildAndStart();
          FUZZ_CHECK(server != nullptr);
          std::shared_ptr<grpc::Channel> channel =
              server->InProcessChannel(grpc::ChannelArguments());
          job_stub = v1::JobService::NewStub(channel);
          control_stub = v1::RackControl::NewStub(channel);
        }
      }
      CallMethod(which, bytes, jobs, control, job_stub.get(), control_stub.get(), assignments);
      now_ms += 250;  // time passes between calls: heartbeats expire, jobs get scheduled
      rack.Tick();
    }
    assignments.CloseAll();
    if (server != nullptr) {
      // Streams still open end within one poll; a hung handler makes this time out.
      server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    }
    rack.Shutdown();
  }
  std::filesystem::remove_all(dir);
  return 0;
}
