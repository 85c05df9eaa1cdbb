// TrainingSession: the one set-up of a training run that both drivers go through — the
// direct launch (`rackrun train`) and the worker daemon's job runner — so the order of
// create, resume and prepare lives in one place:
//   1. create the Trainer from a validated spec and the data channel (null = one rank);
//   2. resume: from the checkpoint file or folder the user named (`rackrun train
//      --resume`), or, for a restarted attempt of a daemon job, from the spec's own
//      checkpoint.dir when it holds checkpoints — only when this run (TrainerOptions::
//      owner) wrote them: a folder another run wrote is refused, never adopted;
//   3. Prepare: every output checked and the checkpoint folder claimed before the first
//      step, on every rank.
// Start reports the stage a failure happened in, so the worker names the phase it reports
// and the CLI the flag or file at fault. After Start the driver runs the trainer with its
// own observers (log lines for the CLI, progress reports and metrics for the worker) and
// stops it with Trainer::RequestStop from its signal handler or its cancel stream.
//
// What comes before is the driver's own: whether the job fits this machine
// (CheckJobFitsThisMachine, before the channel so peers are not left waiting) and the
// channel (MPI for the CLI, the job's channel for the worker).
//
// Thread safety: Start and the accessors on one thread; the trainer's own rules after.
#ifndef RACKRUN_RUNTIME_TRAINING_SESSION_H_
#define RACKRUN_RUNTIME_TRAINING_SESSION_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/data_channel.h"
#include "rackrun/v1/job_spec.pb.h"
#include "runtime/trainer.h"

namespace rackrun::runtime {

// Where TrainingSession::Start failed.
enum class SessionStage {
  kCreate,   // Trainer::Create: the spec on these ranks, the data, the model, the group
  kResume,   // reading the checkpoint, or a checkpoint folder this run did not write
  kPrepare,  // outputs and the checkpoint folder (Trainer::Prepare)
};

struct SessionOptions {
  TrainerOptions trainer;
  // A checkpoint file or folder to resume from (`rackrun train --resume`); empty = none.
  std::string resume_from;
  // A restarted attempt: continue the spec's checkpoint.dir when it holds checkpoints
  // written by trainer.owner (FailedPrecondition naming checkpoint.dir when another run
  // wrote them). Ignored when resume_from is set.
  bool resume_own_checkpoints = false;
};

class TrainingSession {
 public:
  // Creates, resumes and prepares (steps 1-3 above). On error `*failed` (when not null)
  // is the stage that failed; the status is the trainer's own.
  static absl::StatusOr<std::unique_ptr<TrainingSession>> Start(const rackrun::v1::JobSpec& spec,
                                                                comm::DataChannel* channel,
                                                                const SessionOptions& options,
                                                                SessionStage* failed = nullptr);

  Trainer& trainer() { return *trainer_; }
  const Trainer& trainer() const { return *trainer_; }
  // The checkpoint resumed from; empty when the run starts at step 0.
  const std::string& resumed_from() const { return resumed_from_; }

 private:
  explicit TrainingSession(std::unique_ptr<Trainer> trainer) : trainer_(std::move(trainer)) {}

  std::unique_ptr<Trainer> trainer_;
  std::string resumed_from_;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_TRAINING_SESSION_H_
