// The training log as a trainer observer: every logging.interval steps, the last step and
// every evaluated step make one record whose tokens/s covers the steps since the previous
// record (evaluation and checkpoint time excluded), handed to a callback (the CLI's log
// line) and/or appended to a JSON Lines file (logging.json, `--log-json`). Attach it on
// rank 0 only (the trainer does so itself for logging.json).
#ifndef RACKRUN_RUNTIME_STEP_LOG_H_
#define RACKRUN_RUNTIME_STEP_LOG_H_

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/trainer.h"

namespace rackrun::runtime {

// Balancing's own cost in a step, as a share of the step (0 when step_s <= 0): the plan
// less its load exchange (the exchange is a wait for the other ranks, not planning work),
// plus the exposed fan-out of replica weights and the replica-gradient reduction. The
// token all-to-alls are not counted: every policy, none included, dispatches its tokens.
double BalancingShare(double plan_s, double plan_exchange_s, double fanout_s, double reduce_s,
                      double step_s);

// A step's expert-parallel phases as the log line prints them (seconds in, milliseconds
// out): "plan(exch)/fan/a2a/red ms 0.7(0.6)/0.4/8.6/0.1 bal 0.4%", the plan phase with its
// load exchange in parentheses, fan-out, token all-to-alls, replica-gradient reduction, and
// BalancingShare of the step. The direct launch's log line and the CLI's progress lines
// (`rackrun watch`, `status`: the daemons' path) print the same text.
std::string BalancingPhasesText(double plan_s, double plan_exchange_s, double fanout_s,
                                double dispatch_s, double reduce_s, double step_s);

class StepLog final : public TrainObserver {
 public:
  // `json_path` empty = no file; `append` continues the file of a resumed run (else it is
  // truncated). InvalidArgument naming logging.json, the file and errno when the file
  // cannot be opened. A write error (disk full) cuts the file back to its last whole
  // record and is kept in status(); nothing more is written.
  static absl::StatusOr<std::unique_ptr<StepLog>> Create(
      int64_t log_interval, int64_t total_steps, const std::string& json_path, bool append,
      std::function<void(const StepRecord&)> on_record);
  ~StepLog() override;

  void OnStep(const StepRecord& record) override;
  // Closes the file; the first write error (disk full) names the file and errno.
  absl::Status Close();
  // OK, or the first write error so far (the trainer stops at it).
  const absl::Status& status() const { return error_; }

 private:
  StepLog() = default;

  int64_t interval_ = 1;
  int64_t total_steps_ = 0;
  std::string json_path_;
  std::FILE* json_ = nullptr;
  std::function<void(const StepRecord&)> on_record_;
  double window_seconds_ = 0;
  int64_t window_tokens_ = 0;
  absl::Status error_;
  long good_bytes_ = 0;  // the file's length after the last whole record
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_STEP_LOG_H_
