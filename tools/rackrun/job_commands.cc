// rackrun status, cancel, list, workers: one call (or one paged walk) to the coordinator's
// JobService each, printed as text or, with --json, as the response message.
#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/ascii.h"
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

// Arguments shared by the four commands: connection flags, --json, the positional ones,
// and command-specific options with a value (`valued`) or without (`switches`).
struct Parsed {
  ConnectionFlags flags;
  bool json = false;
  std::vector<std::string> positional;
  std::vector<std::pair<std::string, std::string>> options;
  std::vector<std::string> switches;
  bool help = false;
  std::string error;
};

Parsed Parse(const Args& args, const std::vector<std::string_view>& valued,
             const std::vector<std::string_view>& switches, bool json_allowed) {
  Parsed p;
  for (size_t i = 0; i < args.size() && p.error.empty(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      p.help = true;
      return p;
    }
    if (p.flags.Consume(args, &i, &p.error)) continue;
    if (json_allowed && a == "--json") {
      p.json = true;
    } else if (std::find(switches.begin(), switches.end(), a) != switches.end()) {
      p.switches.push_back(a);
    } else if (std::find(valued.begin(), valued.end(), a) != valued.end()) {
      if (i + 1 >= args.size()) {
        p.error = "option '" + a + "' needs a value";
      } else {
        p.options.emplace_back(a, args[++i]);
      }
    } else if (a.rfind("--", 0) == 0) {
      p.error = "unknown option '" + a + "'";
    } else {
      p.positional.push_back(a);
    }
  }
  return p;
}

std::string OptionOr(const Parsed& p, std::string_view name, std::string fallback) {
  for (const auto& [k, v] : p.options) {
    if (k == name) fallback = v;
  }
  return fallback;
}

bool HasSwitch(const Parsed& p, std::string_view name) {
  return std::find(p.switches.begin(), p.switches.end(), name) != p.switches.end();
}

int Usage(std::string_view command, std::string_view usage, std::string_view error) {
  std::fprintf(stderr, "rackrun %.*s: %.*s\n\n%.*s", static_cast<int>(command.size()),
               command.data(), static_cast<int>(error.size()), error.data(),
               static_cast<int>(usage.size()), usage.data());
  return 2;
}

int Help(std::string_view usage) {
  std::fwrite(usage.data(), 1, usage.size(), stdout);
  std::fputs(kConnectionHelp, stdout);
  return 0;
}

// The client, or nullptr after printing why not.
std::unique_ptr<CoordinatorClient> Connect(const ConnectionFlags& flags) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = CoordinatorClient::Create(flags);
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

constexpr std::string_view kStatusUsage =
    R"(usage: rackrun status JOB [--json] [connection options]

Shows job JOB: state, outcome, attempts with the worker of every rank, the first failure
(kind, rank, worker, host, pid, phase, step) and the last progress report.
  --json   print the Job message as JSON

)";

void PrintStatus(const Job& job) {
  std::vector<std::vector<std::string>> rows = {
      {"job", absl::StrCat(job.id(), job.name().empty() ? "" : absl::StrCat(" (", job.name(), ")"))},
      {"state", StateName(job.state())},
  };
  if (!job.message().empty()) rows.push_back({"message", job.message()});
  rows.push_back({"created", TimeText(job.created_unix_ms())});
  rows.push_back({"started", TimeText(job.started_unix_ms())});
  rows.push_back({"finished", TimeText(job.finished_unix_ms())});
  rows.push_back({"restarts", absl::StrCat(job.restarts())});
  if (job.has_last_progress()) rows.push_back({"progress", ProgressLine(job.last_progress())});
  if (job.has_first_failure()) rows.push_back({"first failure", FailureLine(job.first_failure())});
  if (!job.request_id().empty()) rows.push_back({"request id", job.request_id()});
  PrintTable(rows);
  for (const rackrun::v1::Attempt& a : job.attempts()) {
    std::printf("attempt %d: %s, from step %lld, started %s, finished %s\n", a.number(),
                StateName(a.state()).c_str(), static_cast<long long>(a.start_step()),
                TimeText(a.started_unix_ms()).c_str(), TimeText(a.finished_unix_ms()).c_str());
    for (const rackrun::v1::RankPlacement& r : a.ranks()) {
      std::printf("  rank %d: worker %s, host %s, pid %d\n", r.rank(), r.worker_id().c_str(),
                  r.host().c_str(), r.pid());
    }
    if (a.has_failure()) std::printf("  failed: %s\n", FailureLine(a.failure()).c_str());
  }
}

constexpr std::string_view kCancelUsage =
    R"(usage: rackrun cancel JOB [--reason TEXT] [connection options]

Cancels job JOB (queued or running: every rank stops at the same step boundary) and prints
its state. Fails when the job already ended.
  --reason TEXT   recorded with the job (default: "cancelled by <user> with rackrun cancel")

)";

constexpr std::string_view kListUsage =
    R"(usage: rackrun list [--state STATE] [--limit N] [--json] [connection options]

Lists jobs, newest first: id, state, step, name, created, outcome.
  --state STATE   only jobs in STATE: queued, running, succeeded, failed, cancelled
  --limit N       at most N jobs (default 100; 0 = all), fetched page by page
  --json          print a ListJobsResponse message (every page's jobs) as JSON

)";

constexpr std::string_view kWorkersUsage =
    R"(usage: rackrun workers [--all] [--json] [connection options]

Lists the workers registered with the coordinator: id, host, pid, launcher rank, device,
state, job, rank, step, phase, heartbeat age and last step time.
  --all    include workers that deregistered
  --json   print the ListWorkersResponse message as JSON

)";

}  // namespace

int StatusCommand(const Args& args) {
  Parsed p = Parse(args, {}, {}, /*json_allowed=*/true);
  if (p.help) return Help(kStatusUsage);
  if (!p.error.empty()) return Usage("status", kStatusUsage, p.error);
  if (p.positional.size() != 1) return Usage("status", kStatusUsage, "give exactly one JOB");
  std::unique_ptr<CoordinatorClient> client = Connect(p.flags);
  if (client == nullptr) return 1;
  std::unique_ptr<grpc::ClientContext> ctx = client->NewContext();
  rackrun::v1::GetJobRequest request;
  request.set_job_id(p.positional[0]);
  Job job;
  grpc::Status s = client->stub().Get(ctx.get(), request, &job);
  if (!s.ok()) return CallFailed(*client, s);
  if (p.json) {
    PrintJson(job);
  } else {
    PrintStatus(job);
  }
  return 0;
}

int CancelCommand(const Args& args) {
  Parsed p = Parse(args, {"--reason"}, {}, /*json_allowed=*/false);
  if (p.help) return Help(kCancelUsage);
  if (!p.error.empty()) return Usage("cancel", kCancelUsage, p.error);
  if (p.positional.size() != 1) return Usage("cancel", kCancelUsage, "give exactly one JOB");
  std::unique_ptr<CoordinatorClient> client = Connect(p.flags);
  if (client == nullptr) return 1;
  const char* user = std::getenv("USER");
  rackrun::v1::CancelJobRequest request;
  request.set_job_id(p.positional[0]);
  request.set_reason(OptionOr(
      p, "--reason",
      absl::StrCat("cancelled by ", user != nullptr ? user : "a user", " with rackrun cancel")));
  std::unique_ptr<grpc::ClientContext> ctx = client->NewContext();
  Job job;
  grpc::Status s = client->stub().Cancel(ctx.get(), request, &job);
  if (!s.ok()) return CallFailed(*client, s);
  std::printf("job %s: %s\n", job.id().c_str(), StateName(job.state()).c_str());
  return 0;
}

int ListCommand(const Args& args) {
  Parsed p = Parse(args, {"--state", "--limit"}, {}, /*json_allowed=*/true);
  if (p.help) return Help(kListUsage);
  if (!p.error.empty()) return Usage("list", kListUsage, p.error);
  if (!p.positional.empty()) {
    return Usage("list", kListUsage, "unexpected argument '" + p.positional[0] + "'");
  }
  rackrun::v1::JobState state = rackrun::v1::JOB_STATE_UNSPECIFIED;
  if (const std::string s = OptionOr(p, "--state", ""); !s.empty()) {
    if (!rackrun::v1::JobState_Parse(absl::AsciiStrToUpper(s), &state) ||
        state == rackrun::v1::JOB_STATE_UNSPECIFIED) {
      return Usage("list", kListUsage,
                   "--state: '" + s + "' is not a job state; use queued, running, succeeded, "
                   "failed or cancelled");
    }
  }
  int limit = 100;
  if (const std::string l = OptionOr(p, "--limit", "100"); !absl::SimpleAtoi(l, &limit) || limit < 0) {
    return Usage("list", kListUsage, "--limit: '" + l + "' is not a number >= 0");
  }
  std::unique_ptr<CoordinatorClient> client = Connect(p.flags);
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
  if (p.json) {
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
  Parsed p = Parse(args, {}, {"--all"}, /*json_allowed=*/true);
  if (p.help) return Help(kWorkersUsage);
  if (!p.error.empty()) return Usage("workers", kWorkersUsage, p.error);
  if (!p.positional.empty()) {
    return Usage("workers", kWorkersUsage, "unexpected argument '" + p.positional[0] + "'");
  }
  std::unique_ptr<CoordinatorClient> client = Connect(p.flags);
  if (client == nullptr) return 1;
  rackrun::v1::ListWorkersRequest request;
  request.set_include_gone(HasSwitch(p, "--all"));
  std::unique_ptr<grpc::ClientContext> ctx = client->NewContext();
  rackrun::v1::ListWorkersResponse response;
  grpc::Status s = client->stub().ListWorkers(ctx.get(), request, &response);
  if (!s.ok()) return CallFailed(*client, s);
  if (p.json) {
    PrintJson(response);
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {{"ID", "HOST", "PID", "LRANK", "DEVICE", "STATE",
                                                 "JOB", "RANK", "STEP", "PHASE", "HEARTBEAT",
                                                 "STEP TIME"}};
  for (const rackrun::v1::Worker& w : response.workers()) {
    const bool busy = !w.job_id().empty();
    rows.push_back({w.id(), w.host(), absl::StrCat(w.pid()),
                    w.launcher_rank() >= 0 ? absl::StrCat(w.launcher_rank()) : "-", w.device(),
                    rackrun::v1::WorkerState_Name(w.state()), busy ? w.job_id() : "-",
                    busy ? absl::StrCat(w.rank()) : "-", busy ? absl::StrCat(w.step()) : "-",
                    w.phase().empty() ? "-" : w.phase(),
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
