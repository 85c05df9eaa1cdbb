// rackrun submit: validates a job spec here, then queues it on the rack coordinator.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/channel_names.h"
#include "jobspec/spec.h"
#include "tools/rackrun/client.h"
#include "tools/rackrun/command.h"
#include "tools/rackrun/job_view.h"

namespace rackrun::cli {
namespace {

constexpr const char* kDescription =
    R"(Queues the job described by SPEC (a YAML or JSON JobSpec, proto/rackrun/v1/job_spec.proto)
on the rack coordinator and prints its id on stdout. The spec is loaded and validated here
first (a bad spec fails before anything is sent, naming the field), and its paths (data,
checkpoints, logs) are made absolute against the current directory: the workers read
them, so they must be visible to every worker (e.g. a shared file system).

Submit is idempotent by request id: while the coordinator is unavailable or slow, submit
retries with the same id, and a retried submit never creates a second job ("already
submitted" then names the existing one).
)";

constexpr const char* kExitCodes =
    R"(exit code: 0 queued (or already submitted), 1 failed (bad spec, coordinator error),
2 usage error; with --watch those of 'rackrun watch' (3 when nothing was queued).
)";

// Loads and validates the spec, its paths made absolute against the current directory; on
// an error, prints it and returns nothing.
std::optional<rackrun::v1::JobSpec> LoadSpecHere(const std::string& spec_path,
                                                 const std::vector<std::string>& overrides) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = jobspec::LoadJobSpec(spec_path, overrides);
  if (!spec.ok()) {
    std::fprintf(stderr, "rackrun submit: %s\n", std::string(spec.status().message()).c_str());
    return std::nullopt;
  }
  std::error_code ec;
  const std::filesystem::path cwd = std::filesystem::current_path(ec);
  if (ec) {
    std::fprintf(stderr, "rackrun submit: cannot read the current directory (%s)\n",
                 ec.message().c_str());
    return std::nullopt;
  }
  jobspec::MakeSpecPathsAbsolute(*spec, cwd.string());
  return *std::move(spec);
}

// Says on stderr whether the request created the job or found it submitted before.
void PrintSubmitted(const rackrun::v1::SubmitRequest& request,
                    const rackrun::v1::SubmitResponse& response) {
  const rackrun::v1::Job& job = response.job();
  if (response.created()) {
    std::fprintf(stderr, "rackrun: submitted job %s (%s), %s; request id %s\n", job.id().c_str(),
                 job.name().c_str(), StateName(job.state()).c_str(), request.request_id().c_str());
  } else {
    std::fprintf(stderr,
                 "rackrun: request id %s was already submitted as job %s (%s); not submitted "
                 "again\n",
                 request.request_id().c_str(), job.id().c_str(), StateName(job.state()).c_str());
  }
}

}  // namespace

int SubmitCommand(const Args& args) {
  std::string spec_path;
  std::vector<std::string> overrides;
  std::string request_id;
  bool watch = false;
  ConnectionFlags connection;
  FollowOptions follow;
  follow.live = isatty(STDOUT_FILENO) != 0;
  flags::FlagSet flag_set("rackrun submit",
                          "SPEC [--set FIELD=VALUE]... [--request-id ID] [--watch [--every N]\n"
                          "                      [--plain]] [--retry-for SECONDS] "
                          "[connection options]");
  // The channel choices from comm's one list (channel_names.h).
  flag_set.Describe(absl::StrCat(
      kDescription,
      "\nThe workers connect the job's ranks by the data channel resources.channel names: ",
      comm::ChannelChoices(), ".\n"));
  flag_set.Epilogue(kExitCodes);
  flag_set.Positional("SPEC", &spec_path, "the job spec file (YAML or JSON)");
  flag_set.Strings("--set", &overrides, "FIELD=VALUE",
                   "override a spec field, e.g. --set training.steps=50 (repeatable)");
  flag_set
      .Custom("--request-id", "ID",
              "the request id; reuse it to retry a submit whose outcome you did not see",
              [&request_id](std::string_view value) {
                if (value.empty()) return absl::InvalidArgumentError("must not be empty");
                request_id = std::string(value);
                return absl::OkStatus();
              })
      .Default("a fresh random UUID");
  flag_set.Switch("--watch", &watch,
                  "then follow the job like 'rackrun watch' (and exit with its outcome: 0 "
                  "SUCCEEDED, 1 FAILED, 2 CANCELLED, 3 no outcome)");
  flag_set.Section("with --watch (as for 'rackrun watch'); --retry-for also for the submit itself");
  DeclareFollowFlags(flag_set, &follow);
  connection.Declare(flag_set);
  // A usage error exits as the command would have: 3 (no outcome) when --watch was asked.
  const bool watch_asked = std::find(args.begin(), args.end(), "--watch") != args.end();
  if (std::optional<int> exit = flag_set.ParseCommandLine(args, watch_asked ? kExitNoOutcome : 2)) {
    return *exit;
  }
  const int failed = watch ? kExitNoOutcome : 1;

  // Locally first: a bad spec never reaches the network.
  std::optional<rackrun::v1::JobSpec> spec = LoadSpecHere(spec_path, overrides);
  if (!spec.has_value()) return failed;

  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = CoordinatorClient::Create(connection);
  if (!client.ok()) {
    std::fprintf(stderr, "rackrun: %s\n", std::string(client.status().message()).c_str());
    return failed;
  }
  CoordinatorClient& c = **client;
  rackrun::v1::SubmitRequest request;
  *request.mutable_spec() = *std::move(spec);
  request.set_request_id(request_id.empty() ? NewRequestId() : request_id);
  rackrun::v1::SubmitResponse response;
  grpc::Status s = c.WithRetry(
      [&](grpc::ClientContext* ctx) { return c.stub().Submit(ctx, request, &response); },
      follow.retry,
      [&](const grpc::Status& first) {
        std::fprintf(stderr, "rackrun: %s; retrying with request id %s for up to %lld s\n",
                     c.DescribeError(first).c_str(), request.request_id().c_str(),
                     static_cast<long long>(follow.retry.budget.count() / 1000));
      });
  if (!s.ok()) {
    std::fprintf(stderr, "rackrun: %s\n", c.DescribeError(s).c_str());
    if (IsRetryable(s)) {
      std::fprintf(stderr,
                   "rackrun: to retry without creating a second job: rackrun submit %s "
                   "--request-id %s\n",
                   spec_path.c_str(), request.request_id().c_str());
    }
    return failed;
  }
  const rackrun::v1::Job& job = response.job();
  std::printf("%s\n", job.id().c_str());
  std::fflush(stdout);
  PrintSubmitted(request, response);
  if (!watch) return 0;
  return FollowJob(c, job.id(), follow);
}

}  // namespace rackrun::cli
