#include "runtime/training_session.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/checkpoint.h"

namespace rackrun::runtime {

absl::StatusOr<std::unique_ptr<TrainingSession>> TrainingSession::Start(
    const rackrun::v1::JobSpec& spec, comm::DataChannel* channel, const SessionOptions& options,
    SessionStage* failed) {
  const auto at = [failed](SessionStage stage) {
    if (failed != nullptr) *failed = stage;
  };
  at(SessionStage::kCreate);
  absl::StatusOr<std::unique_ptr<Trainer>> trainer =
      Trainer::Create(spec, channel, options.trainer);
  if (!trainer.ok()) return trainer.status();
  std::unique_ptr<TrainingSession> session(new TrainingSession(*std::move(trainer)));

  at(SessionStage::kResume);
  std::string resume = options.resume_from;
  const std::string& dir = spec.checkpoint().dir();
  if (resume.empty() && options.resume_own_checkpoints && !dir.empty() &&
      !ListCheckpoints(dir).empty()) {
    // A restarted attempt continues its own checkpoints, never another run's (an earlier
    // attempt refused on a folder in use must not adopt it on the next).
    absl::StatusOr<std::string> owner = CheckpointFolderOwner(dir);
    if (!owner.ok() || *owner != options.trainer.owner) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.dir: '", dir, "' holds checkpoints this job did not write (owner: ",
          owner.ok() ? *owner : std::string("not recorded"),
          "); the restarted attempt does not continue them; resubmit with another "
          "checkpoint.dir or checkpoint.start_over: true"));
    }
    resume = dir;
  }
  if (!resume.empty()) {
    if (absl::Status s = session->trainer_->Resume(resume); !s.ok()) return s;
    session->resumed_from_ = resume;
  }

  at(SessionStage::kPrepare);
  if (absl::Status s = session->trainer_->Prepare(); !s.ok()) return s;
  return session;
}

}  // namespace rackrun::runtime
