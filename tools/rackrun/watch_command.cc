// rackrun watch: follows a job's events to its end; the exit code is the job's outcome.
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tools/rackrun/command.h"
#include "tools/rackrun/job_view.h"

namespace rackrun::cli {
namespace {

using rackrun::v1::JobEvent;
using rackrun::v1::JobState;
using Clock = std::chrono::steady_clock;

constexpr const char* kDescription =
    R"(Follows job JOB from its first event to its end. On a terminal: a progress bar redrawn in
place (step/total, loss, validation loss, tokens/s, rank imbalance before -> after balancing
(mean over MoE layers), ETA, restarts) with state changes and failures as lines above it.
Otherwise (a pipe, a file): one line per state change, failure and message, and one per
N steps of progress.

If the coordinator goes away (restart, network), watch reconnects and resumes after the
last event it printed: nothing is lost or printed twice.
)";

constexpr const char* kExitCodes =
    R"(exit code (also for submit --watch):
  0  the job SUCCEEDED
  1  the job FAILED
  2  the job was CANCELLED
  3  no outcome: a usage error, or the job could not be followed (coordinator unreachable,
     token refused, no such job)
)";

bool IsTerminal(JobState s) {
  return s == rackrun::v1::SUCCEEDED || s == rackrun::v1::FAILED || s == rackrun::v1::CANCELLED;
}

int ExitCodeOf(JobState s) {
  switch (s) {
    case rackrun::v1::SUCCEEDED:
      return kExitSucceeded;
    case rackrun::v1::FAILED:
      return kExitFailed;
    case rackrun::v1::CANCELLED:
      return kExitCancelled;
    default:
      return kExitNoOutcome;
  }
}

std::string DurationText(double seconds) {
  if (seconds < 0) return "-";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

std::string RateText(double tokens_per_s) {
  if (tokens_per_s >= 1e6) return absl::StrFormat("%.1fM", tokens_per_s / 1e6);
  if (tokens_per_s >= 1e4) return absl::StrFormat("%.1fk", tokens_per_s / 1e3);
  return absl::StrFormat("%.0f", tokens_per_s);
}

// What the job's events print: lines, and on a terminal the progress bar kept as the last
// line (cleared before a line is printed above it, redrawn after).
class EventPrinter {
 public:
  EventPrinter(std::string job_id, const FollowOptions& options)
      : job_id_(std::move(job_id)), options_(options) {
    winsize ws{};
    if (options_.live && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 20) {
      width_ = ws.ws_col;
    }
  }

  void Show(const JobEvent& e) {
    if (e.attempt() > 1) restarts_ = std::max<int64_t>(restarts_, e.attempt() - 1);
    switch (e.event_case()) {
      case JobEvent::kState:
        Line(absl::StrCat(StateName(e.state()), e.state() == rackrun::v1::RUNNING && e.attempt() > 0
                                                    ? absl::StrCat(" (attempt ", e.attempt(), ")")
                                                    : ""));
        break;
      case JobEvent::kFailure:
        Line(absl::StrCat("attempt ", e.attempt(), " failed: ", FailureLine(e.failure())));
        break;
      case JobEvent::kMessage:
        Line(e.message());
        break;
      case JobEvent::kProgress:
        Progress(e.progress());
        break;
      default:
        break;
    }
  }

  // Any other line (the outcome, a reconnect note): above the bar.
  void Line(const std::string& text) {
    ClearBar();
    std::printf("job %s: %s\n", job_id_.c_str(), text.c_str());
    DrawBar();
  }

  // Leaves the bar on screen as a finished line.
  void Finish() {
    if (bar_shown_) {
      DrawBar();
      std::printf("\n");
      bar_shown_ = false;
    }
    std::fflush(stdout);
  }

 private:
  void Progress(const rackrun::v1::StepProgress& p) {
    if (p.step_time_s() > 0) {
      step_time_ = step_time_ <= 0 ? p.step_time_s() : 0.9 * step_time_ + 0.1 * p.step_time_s();
    }
    last_ = p;
    has_progress_ = true;
    if (options_.live) {
      const Clock::time_point now = Clock::now();
      if (now - last_draw_ >= std::chrono::milliseconds(100) || p.step() >= p.total_steps()) {
        DrawBar();
      }
      return;
    }
    if (options_.every <= 1 || p.step() % options_.every == 0 || p.step() >= p.total_steps()) {
      Line(ProgressLine(p));
    }
  }

  void ClearBar() {
    if (bar_shown_) std::printf("\r\x1b[K");
  }

  void DrawBar() {
    if (!options_.live || !has_progress_) {
      std::fflush(stdout);
      return;
    }
    const rackrun::v1::StepProgress& p = last_;
    constexpr int kBar = 24;
    const double frac =
        p.total_steps() > 0 ? std::clamp(double(p.step()) / p.total_steps(), 0.0, 1.0) : 0.0;
    const int filled = static_cast<int>(frac * kBar);
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < kBar) bar += '>';
    bar.resize(kBar, ' ');
    std::string line =
        absl::StrFormat("[%s] %d/%d  loss %.4f", bar, p.step(), p.total_steps(), p.loss());
    if (p.has_val_loss()) absl::StrAppendFormat(&line, "  val %.4f", p.val_loss());
    absl::StrAppend(&line, "  ", RateText(p.tokens_per_s()), " tok/s");
    if (!p.imbalance_before().empty()) {
      absl::StrAppendFormat(&line, "  imbalance %.2f -> %.2f", MeanOf(p.imbalance_before()),
                            MeanOf(p.imbalance_after()));
    }
    const double eta = step_time_ > 0 ? step_time_ * double(p.total_steps() - p.step()) : -1;
    absl::StrAppend(&line, "  ETA ", DurationText(eta), "  restarts ", restarts_);
    if (static_cast<int>(line.size()) >= width_) line.resize(static_cast<size_t>(width_ - 1));
    std::printf("\r%s\x1b[K", line.c_str());
    std::fflush(stdout);
    bar_shown_ = true;
    last_draw_ = Clock::now();
  }

  std::string job_id_;
  FollowOptions options_;
  int width_ = 120;
  bool bar_shown_ = false;
  bool has_progress_ = false;
  rackrun::v1::StepProgress last_;
  double step_time_ = 0;
  int64_t restarts_ = 0;
  Clock::time_point last_draw_{};
};

}  // namespace

int FollowJob(CoordinatorClient& client, const std::string& job_id, const FollowOptions& options) {
  EventPrinter printer(job_id, options);
  int64_t last_seq = 0;
  JobState final_state = rackrun::v1::JOB_STATE_UNSPECIFIED;
  std::chrono::milliseconds backoff = options.retry.initial_backoff;
  Clock::time_point give_up = Clock::now() + options.retry.budget;
  bool reconnecting = false;
  for (;;) {
    std::unique_ptr<grpc::ClientContext> ctx = client.NewContext(/*deadline=*/false);
    rackrun::v1::WatchJobRequest request;
    request.set_job_id(job_id);
    request.set_from_seq(last_seq);
    std::unique_ptr<grpc::ClientReader<JobEvent>> reader = client.stub().Watch(ctx.get(), request);
    JobEvent e;
    while (reader->Read(&e)) {
      if (reconnecting) {
        printer.Line(absl::StrCat("(reconnected to the coordinator at ", client.address(),
                                  ", resuming after event ", last_seq, ")"));
        reconnecting = false;
      }
      backoff = options.retry.initial_backoff;
      give_up = Clock::now() + options.retry.budget;
      if (e.seq() <= last_seq) continue;  // never show an event twice
      last_seq = e.seq();
      printer.Show(e);
      if (e.event_case() == JobEvent::kState && IsTerminal(e.state())) final_state = e.state();
    }
    grpc::Status s = reader->Finish();
    if (IsTerminal(final_state)) break;
    if (s.ok()) {
      // The stream ended without a terminal event (it ends only after one): ask the job.
      std::unique_ptr<grpc::ClientContext> get_ctx = client.NewContext();
      rackrun::v1::GetJobRequest get;
      get.set_job_id(job_id);
      rackrun::v1::Job job;
      s = client.stub().Get(get_ctx.get(), get, &job);
      if (s.ok() && IsTerminal(job.state())) {
        final_state = job.state();
        printer.Line(StateName(job.state()));
        break;
      }
      if (s.ok()) continue;
    }
    // CANCELLED here is the server's doing (shutdown), never ours: retry it like UNAVAILABLE.
    const bool retry = IsRetryable(s) || s.error_code() == grpc::StatusCode::CANCELLED;
    if (!retry || Clock::now() >= give_up) {
      printer.Finish();
      std::fprintf(stderr, "rackrun: %s\n", client.DescribeError(s).c_str());
      return kExitNoOutcome;
    }
    if (!reconnecting) {
      printer.Line(
          absl::StrCat("(lost the coordinator at ", client.address(), ": ",
                       absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())),
                       "; reconnecting for up to ", options.retry.budget.count() / 1000, " s)"));
      reconnecting = true;
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, options.retry.max_backoff);
  }
  // The outcome in one line, when the coordinator recorded one.
  std::unique_ptr<grpc::ClientContext> ctx = client.NewContext();
  rackrun::v1::GetJobRequest get;
  get.set_job_id(job_id);
  rackrun::v1::Job job;
  if (client.stub().Get(ctx.get(), get, &job).ok() && !job.message().empty()) {
    printer.Line(absl::StrCat(StateName(final_state), ": ", job.message()));
  }
  printer.Finish();
  return ExitCodeOf(final_state);
}

void DeclareFollowFlags(flags::FlagSet& flag_set, FollowOptions* options) {
  flag_set.Int("--every", &options->every, "N", "plain lines: a progress line every N steps")
      .Range(1);
  flag_set.Switch("--plain", "plain lines even on a terminal",
                  [options] { options->live = false; });
  flag_set
      .Custom("--retry-for", "SECONDS", "keep reconnecting to an unavailable coordinator this long",
              [options](std::string_view value) {
                absl::StatusOr<double> s = flags::ParseDouble(value, 0);
                if (!s.ok()) return s.status();
                options->retry.budget = std::chrono::milliseconds(static_cast<int64_t>(*s * 1000));
                return absl::OkStatus();
              })
      .Default(absl::StrCat(options->retry.budget.count() / 1000.0));
}

int WatchCommand(const Args& args) {
  std::string job_id;
  ConnectionFlags connection;
  FollowOptions options;
  options.live = isatty(STDOUT_FILENO) != 0;
  flags::FlagSet flag_set("rackrun watch",
                          "JOB [--every N] [--plain] [--retry-for SECONDS] "
                          "[connection options]");
  flag_set.Describe(kDescription);
  flag_set.Epilogue(kExitCodes);
  flag_set.Positional("JOB", &job_id, "the job's id");
  DeclareFollowFlags(flag_set, &options);
  connection.Declare(flag_set);
  if (std::optional<int> exit = flag_set.ParseCommandLine(args, kExitNoOutcome)) return *exit;
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = CoordinatorClient::Create(connection);
  if (!client.ok()) {
    std::fprintf(stderr, "rackrun: %s\n", std::string(client.status().message()).c_str());
    return kExitNoOutcome;
  }
  return FollowJob(**client, job_id, options);
}

}  // namespace rackrun::cli
