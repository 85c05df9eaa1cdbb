// How the job commands show jobs, events and workers: one-line texts for failures,
// progress and states, and following a job's event stream (watch, submit --watch).
#ifndef RACKRUN_TOOLS_RACKRUN_JOB_VIEW_H_
#define RACKRUN_TOOLS_RACKRUN_JOB_VIEW_H_

#include <cstdint>
#include <string>
#include <vector>

#include "flags/flags.h"
#include "google/protobuf/message.h"
#include "rackrun/v1/job_service.pb.h"
#include "tools/rackrun/client.h"

namespace rackrun::cli {

// Exit codes of `watch` and `submit --watch`: the job's outcome.
inline constexpr int kExitSucceeded = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitCancelled = 2;
inline constexpr int kExitNoOutcome = 3;  // usage error, or the job could not be followed

// "QUEUED", "RUNNING", ... (the enum's name).
std::string StateName(rackrun::v1::JobState state);

// "WORKER_LOST rank 1 (worker w-2, host h, pid 12) in backward at step 57: message".
std::string FailureLine(const rackrun::v1::Failure& failure);

// "step 120/500 loss 4.1234 val 4.2100 1234 tok/s imbalance 1.85 -> 1.02
// plan(exch)/fan/a2a/red ms 0.7(0.6)/0.4/8.6/0.1 step 0.120 s elapsed 14.2 s" (the
// imbalance and the expert-parallel phases only for expert-parallel jobs).
std::string ProgressLine(const rackrun::v1::StepProgress& progress);

// Per expert-parallel domain of a job with more than one (StepProgress.domains), one line
// each: "domain 1: ranks 2-3, imbalance 1.85 -> 1.02 (worst layer 0: 2.40 -> 1.05), step's
// tokens per rank max/mean 1.12 -> 1.00" (imbalance: the mean over the MoE layers of each
// layer's max/mean, the worst layer by imbalance after; tokens: summed over the step's
// layers and microbatches, so smoother). Empty with one domain.
std::vector<std::string> DomainLines(const rackrun::v1::StepProgress& progress);

// Mean of the per-layer values, 0 when there are none.
double MeanOf(const google::protobuf::RepeatedField<double>& values);

// Local time "YYYY-MM-DD HH:MM:SS" of a Unix time in ms; "-" for 0.
std::string TimeText(int64_t unix_ms);

// The message as JSON (proto field names), for --json.
std::string ToJson(const google::protobuf::Message& message);

struct FollowOptions {
  bool live = false;  // a progress bar redrawn in place (stdout is a terminal)
  int every = 10;     // plain mode: print a progress line every `every` steps (and the last)
  RetryPolicy retry;  // how long to keep reconnecting to an unavailable coordinator
};

// Follows the job's events until its terminal state, printing them to stdout (errors to
// stderr as one line). Reconnects after UNAVAILABLE / DEADLINE_EXCEEDED (for at most
// options.retry.budget without a successful read) from the last seq printed, so no event
// is lost or printed twice. Returns kExitSucceeded / kExitFailed / kExitCancelled by the
// job's final state, kExitNoOutcome when it cannot follow the job.
int FollowJob(CoordinatorClient& client, const std::string& job_id, const FollowOptions& options);

// Declares the flags watch and submit --watch share (--every N, --plain, --retry-for
// SECONDS) on `flag_set`, bound to `options` (its values are the defaults shown).
void DeclareFollowFlags(flags::FlagSet& flag_set, FollowOptions* options);

}  // namespace rackrun::cli

#endif  // RACKRUN_TOOLS_RACKRUN_JOB_VIEW_H_
