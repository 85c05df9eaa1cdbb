// rackrun status, cancel, list, workers: one call (or one paged walk) to the coordinator's
// JobService each, printed as text or, with --json, as the response message.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "tools/rackrun/client.h"
#include "tools/rackrun/command.h"
#include "tools/rackrun/job_view.h"

namespace rackrun::cli {
namespace {

using rackrun::v1::Job;

// A job command's flags: its usage line and description; the caller declares its own flags
// on set(), and Parse adds the connection flags after them.
class JobCommandFlags {
 public:
  JobCommandFlags(std::string command, std::string synopsis, std::string description)
      : set_(absl::StrCat("rackrun ", command), std::move(synopsis)) {
    set_.Describe(std::move(description));
  }
  flags::FlagSet& set() { return set_; }
  const ConnectionFlags& connection() const { return connection_; }

  // The connection flags, then the parse: nullopt to go on, else the exit code.
  std::optional<int> Parse(const Args& args) {
    connection_.Declare(set_);
    return set_.ParseCommandLine(args);
  }

 private:
  flags::FlagSet set_;
  ConnectionFlags connection_;
};

// The client, or nullptr after printing why not.
std::unique_ptr<CoordinatorClient> Connect(const ConnectionFlags& connection) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = CoordinatorClient::Create(connection);
  if (!client.ok()) {
    std::fprintf(stderr, "rackrun: %s\n", std::string(client.status().message()).c_str());
    return nullptr;
  }
  return *std::move(client);
}

int CallFailed(const CoordinatorClient& client, const grpc::Status& s) {
  std::fprintf(stderr, "rackrun: %s\n", client.DescribeError(s).c_str());
  return 1;
}

void PrintJson(const google::protobuf::Message& m) {
  std::string json = ToJson(m);
  if (json.empty() || json.back() != '\n') json += '\n';
  std::fputs(json.c_str(), stdout);
}

// Columns padded to their widest cell; the last column is not padded.
void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      if (c + 1 < row.size()) {
        absl::StrAppend(&line, row[c], std::string(width[c] - row[c].size() + 2, ' '));
      } else {
        absl::StrAppend(&line, row[c]);
      }
    }
    std::printf("%s\n", line.c_str());
  }
}

std::string StepText(const Job& job) {
  if (!job.has_last_progress()) return "-";
  return absl::StrCat(job.last_progress().step(), "/", job.last_progress().total_steps());
}

constexpr const char* kStatusDescription =
    R"(Shows job JOB: state, outcome, attempts with the worker of every rank (with its rack label,
and its expert-parallel domain when the job has several), the first failure (kind, rank,
worker, host, pid, phase, step) and the last progress report; with several expert-parallel
domains, a line per domain: its ranks and its imbalance before -> after.
)";
void PrintStatus(const Job& job) {
  std::vector<std::vector<std::string>> rows = {
      {"job",
       absl::StrCat(job.id(), job.name().empty() ? "" : absl::StrCat(" (", job.name(), ")"))},
      {"state", StateName(job.state())},
  };
  if (!job.message().empty()) rows.push_back({"message", job.message()});
  rows.push_back({"created", TimeText(job.created_unix_ms())});
  rows.push_back({"started", TimeText(job.started_unix_ms())});
  rows.push_back({"finished", TimeText(job.finished_unix_ms())});
  rows.push_back({"restarts", absl::StrCat(job.restarts())});
  if (job.has_last_progress()) {
    rows.push_back({"progress", ProgressLine(job.last_progress())});
    for (const std::string& line : DomainLines(job.last_progress())) {
      const size_t colon = line.find(':');
      rows.push_back({line.substr(0, colon), line.substr(colon + 2)});
    }
  }
  if (job.has_first_failure()) rows.push_back({"first failure", FailureLine(job.first_failure())});
  if (!job.request_id().empty()) rows.push_back({"request id", job.request_id()});
  PrintTable(rows);
  for (const rackrun::v1::Attempt& a : job.attempts()) {
    std::printf("attempt %d: %s, from step %lld, started %s, finished %s\n", a.number(),
                StateName(a.state()).c_str(), static_cast<long long>(a.start_step()),
                TimeText(a.started_unix_ms()).c_str(), TimeText(a.finished_unix_ms()).c_str());
    // Domains and racks are shown when the job has more than one domain / labeled workers.
    const bool domains = std::any_of(a.ranks().begin(), a.ranks().end(),
                                     [](const auto& r) { return r.domain() > 0; });
    for (const rackrun::v1::RankPlacement& r : a.ranks()) {
      std::printf("  rank %d: worker %s, host %s, pid %d%s%s\n", r.rank(), r.worker_id().c_str(),
                  r.host().c_str(), r.pid(), r.rack().empty() ? "" : (", rack " + r.rack()).c_str(),
                  domains ? absl::StrCat(", domain ", r.domain()).c_str() : "");
    }
    if (a.has_failure()) std::printf("  failed: %s\n", FailureLine(a.failure()).c_str());
  }
}

constexpr const char* kCancelDescription =
    R"(Cancels job JOB (queued or running: every rank stops at the same step boundary) and prints
its state. Fails when the job already ended.
)";
constexpr const char* kListDescription =
    R"(Lists jobs, newest first: id, state, step, name, created, outcome.
)";
constexpr const char* kWorkersDescription =
    R"(Lists the workers registered with the coordinator: id, host, rack label (--rack), pid,
launcher rank, device, GPU (name and memory, "-" for a CPU worker), data address, state,
job, rank, step, phase, heartbeat age and last step time.
)";

// The GPU column: "NVIDIA H200 (139.8 GiB)", or "-" for a CPU worker (and one older than
// the field).
std::string GpuText(const rackrun::v1::Worker& w) {
  if (!w.has_gpu()) return "-";
  return absl::StrFormat("%s (%.1f GiB)", w.gpu().name(),
                         static_cast<double>(w.gpu().total_bytes()) / (int64_t{1} << 30));
}

}  // namespace

int StatusCommand(const Args& args) {
  std::string job_id;
  bool json = false;
  JobCommandFlags command("status", "JOB [--json] [connection options]", kStatusDescription);
  command.set().Positional("JOB", &job_id, "the job's id");
  command.set().Switch("--json", &json, "print the Job message as JSON");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  std::unique_ptr<CoordinatorClient> client = Connect(command.connection());
  if (client == nullptr) return 1;
  std::unique_ptr<grpc::ClientContext> ctx = client->NewContext();
  rackrun::v1::GetJobRequest request;
  request.set_job_id(job_id);
  Job job;
  grpc::Status s = client->stub().Get(ctx.get(), request, &job);
  if (!s.ok()) return CallFailed(*client, s);
  if (json) {
    PrintJson(job);
  } else {
    PrintStatus(job);
  }
  return 0;
}

int CancelCommand(const Args& args) {
  std::string job_id;
  const char* user = std::getenv("USER");
  std::string reason =
      absl::StrCat("cancelled by ", user != nullptr ? user : "a user", " with rackrun cancel");
  JobCommandFlags command("cancel", "JOB [--reason TEXT] [connection options]", kCancelDescription);
  command.set().Positional("JOB", &job_id, "the job's id");
  command.set()
      .String("--reason", &reason, "TEXT", "recorded with the job")
      .Default("\"cancelled by <user> with rackrun cancel\"");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  std::unique_ptr<CoordinatorClient> client = Connect(command.connection());
  if (client == nullptr) return 1;
  rackrun::v1::CancelJobRequest request;
  request.set_job_id(job_id);
  request.set_reason(reason);
  std::unique_ptr<grpc::ClientContext> ctx = client->NewContext();
  Job job;
  grpc::Status s = client->stub().Cancel(ctx.get(), request, &job);
  if (!s.ok()) return CallFailed(*client, s);
  std::printf("job %s: %s\n", job.id().c_str(), StateName(job.state()).c_str());
  return 0;
}

int ListCommand(const Args& args) {
  rackrun::v1::JobState state = rackrun::v1::JOB_STATE_UNSPECIFIED;
  int limit = 100;
  bool json = false;
  JobCommandFlags command("list", "[--state STATE] [--limit N] [--json] [connection options]",
                          kListDescription);
  command.set().Custom("--state", "STATE",
                       "only jobs in STATE: queued, running, succeeded, failed, cancelled",
                       [&state](std::string_view value) {
                         const absl::string_view given(value.data(), value.size());
                         const std::string name = absl::AsciiStrToUpper(given);
                         if (!rackrun::v1::JobState_Parse(name, &state) ||
                             state == rackrun::v1::JOB_STATE_UNSPECIFIED) {
                           return absl::InvalidArgumentError(
                               absl::StrCat("'", given,
                                            "' is not a job state; use queued, running, succeeded, "
                                            "failed or cancelled"));
                         }
                         return absl::OkStatus();
                       });
  command.set()
      .Int("--limit", &limit, "N", "at most N jobs (0 = all), fetched page by page")
      .Range(0);
  command.set().Switch("--json", &json,
                       "print a ListJobsResponse message (every page's jobs) as JSON");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  std::unique_ptr<CoordinatorClient> client = Connect(command.connection());
  if (client == nullptr) return 1;

  rackrun::v1::ListJobsResponse all;
  rackrun::v1::ListJobsRequest request;
  request.set_state(state);
  for (;;) {
    const int left = limit == 0 ? 1000 : limit - all.jobs_size();
    request.set_page_size(std::min(left, 1000));
    std::unique_ptr<grpc::ClientContext> ctx = client->NewContext();
    rackrun::v1::ListJobsResponse page;
    grpc::Status s = client->stub().List(ctx.get(), request, &page);
    if (!s.ok()) return CallFailed(*client, s);
    for (Job& job : *page.mutable_jobs()) {
      if (limit != 0 && all.jobs_size() >= limit) break;
      *all.add_jobs() = std::move(job);
    }
    if (page.next_page_token().empty() || (limit != 0 && all.jobs_size() >= limit)) break;
    request.set_page_token(page.next_page_token());
  }
  if (json) {
    PrintJson(all);
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {
      {"ID", "STATE", "STEP", "NAME", "CREATED", "MESSAGE"}};
  for (const Job& job : all.jobs()) {
    rows.push_back({job.id(), StateName(job.state()), StepText(job), job.name(),
                    TimeText(job.created_unix_ms()), job.message()});
  }
  PrintTable(rows);
  return 0;
}

int WorkersCommand(const Args& args) {
  bool all = false;
  bool json = false;
  JobCommandFlags command("workers", "[--all] [--json] [connection options]", kWorkersDescription);
  command.set().Switch("--all", &all, "include workers that deregistered");
  command.set().Switch("--json", &json, "print the ListWorkersResponse message as JSON");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  std::unique_ptr<CoordinatorClient> client = Connect(command.connection());
  if (client == nullptr) return 1;
  rackrun::v1::ListWorkersRequest request;
  request.set_include_gone(all);
  std::unique_ptr<grpc::ClientContext> ctx = client->NewContext();
  rackrun::v1::ListWorkersResponse response;
  grpc::Status s = client->stub().ListWorkers(ctx.get(), request, &response);
  if (!s.ok()) return CallFailed(*client, s);
  if (client->PlaintextOffLoopback()) {
    std::fprintf(stderr,
                 "rackrun: warning: plaintext to %s (the coordinator runs with --insecure): tokens "
                 "and jobs cross the network in clear text\n",
                 client->address().c_str());
  }
  if (json) {
    PrintJson(response);
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {{"ID", "HOST", "RACK", "PID", "LRANK", "DEVICE",
                                                 "GPU", "DATA ADDRESS", "STATE", "JOB", "RANK",
                                                 "STEP", "PHASE", "HEARTBEAT", "STEP TIME"}};
  for (const rackrun::v1::Worker& w : response.workers()) {
    const bool busy = !w.job_id().empty();
    // What UCX uses when it is not the data address itself (UCX's TCP transport takes the
    // interface's first address): "198.19.0.3 (ucx: 198.18.0.3 on eth0)".
    std::string data = w.data_address().empty() ? "-" : w.data_address();
    if (!w.ucx_address().empty() && !absl::StartsWith(w.ucx_address(), w.data_address() + " on ")) {
      absl::StrAppend(&data, " (ucx: ", w.ucx_address(), ")");
    }
    rows.push_back({w.id(), w.host(), w.rack().empty() ? "-" : w.rack(), absl::StrCat(w.pid()),
                    w.launcher_rank() >= 0 ? absl::StrCat(w.launcher_rank()) : "-", w.device(),
                    GpuText(w), data, rackrun::v1::WorkerState_Name(w.state()),
                    busy ? w.job_id() : "-", busy ? absl::StrCat(w.rank()) : "-",
                    busy ? absl::StrCat(w.step()) : "-", w.phase().empty() ? "-" : w.phase(),
                    absl::StrFormat("%.1f s ago", w.heartbeat_age_s()),
                    w.step_time_s() > 0 ? absl::StrFormat("%.3f s", w.step_time_s()) : "-"});
  }
  if (response.workers().empty()) {
    std::printf("no workers registered; start rackrun-worker --coordinator %s\n",
                client->address().c_str());
    return 0;
  }
  PrintTable(rows);
  return 0;
}

}  // namespace rackrun::cli
