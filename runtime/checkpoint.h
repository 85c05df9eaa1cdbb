// Checkpoints: durable, self-checking snapshots of a training job.
//
// A checkpoint is one file `<dir>/step-<step, 8 digits>.ckpt` holding named sections
// (model parameters, optimizer moments, metadata such as the data-loader position and
// RNG state). Layout, integers little-endian:
//   "RKRCKPT1" | uint32 version | uint32 sections | uint64 step
//   per section: uint32 name bytes | name | uint64 payload bytes | payload | uint32 CRC32C(payload)
//   footer: uint64 bytes before the footer | uint32 CRC32C(all bytes before the footer) |
//   "RKRCKEND"
// Writes are atomic (temp file in the same folder, fsync, rename, fsync of the folder),
// so a crash leaves either the old set of checkpoints or the old set plus the new one,
// never a half-written file under a checkpoint name. Older checkpoints are removed only
// after the new one is durable, keeping the newest `keep` (>= 2).
// Reading verifies sizes and every checksum; a truncated or corrupted file is refused
// with an error naming the file and what is wrong; a file that is not a checkpoint at all
// (a job spec passed to --resume) is named as such.
//
// A checkpoint folder belongs to one run (ClaimCheckpointFolder): its writer holds
// `<dir>/LOCK` while training, so a second writer is refused with the holder's pid and
// host; a run that does not continue the folder's own checkpoints is refused unless it
// asks to start over, which moves them into `<dir>/previous-<UTC time>/` (nothing is
// deleted); temporaries of a writer killed mid-write are removed.
#ifndef RACKRUN_RUNTIME_CHECKPOINT_H_
#define RACKRUN_RUNTIME_CHECKPOINT_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/crc32c.h"
#include "base/file.h"

namespace rackrun::runtime {

// Checksums and atomic writes live in base/ (used by specs and data files too).
using base::Crc32c;
using base::ReadWholeFile;
using base::WriteFileAtomically;

struct CheckpointSection {
  std::string name;
  std::string payload;
};

struct Checkpoint {
  int64_t step = 0;
  // CRC32C over the sections' CRC32Cs (set by LoadCheckpoint): identifies the state, so
  // that ranks can check they resumed from the same one. (Not the footer's CRC: a CRC over
  // sections that each end in their own CRC depends only on the names and lengths.)
  uint32_t checksum = 0;
  std::vector<CheckpointSection> sections;

  // The section called `name`, or nullptr.
  const CheckpointSection* Find(std::string_view name) const;
};

// Raw little-endian float storage for tensor sections (this runtime runs on
// little-endian hosts only).
std::string PackFloats(std::span<const float> values);
absl::Status UnpackFloats(const CheckpointSection& section, std::span<float> out);

// File name of the checkpoint of `step` inside `dir`.
std::string CheckpointPath(const std::string& dir, int64_t step);

// Writes `checkpoint` into `dir` (created if missing) and then deletes all but the
// newest `keep` checkpoints there. Returns the new file's path.
absl::StatusOr<std::string> SaveCheckpoint(const std::string& dir, const Checkpoint& checkpoint,
                                           int keep);

// Checkpoint files in `dir`, oldest first (by step).
std::vector<std::string> ListCheckpoints(const std::string& dir);

// Reads and verifies one checkpoint file.
absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& path);

// `path` is a checkpoint file or a checkpoint folder (its newest checkpoint). If the
// newest one is damaged the error names it and the previous good one, which is left
// untouched for the user to resume from explicitly.
absl::StatusOr<Checkpoint> LoadCheckpointForResume(const std::string& path,
                                                   std::string* loaded_path = nullptr);

// How a run relates to the checkpoints already in its folder.
struct CheckpointFolderRun {
  // The checkpoint file this run resumed from (empty: a fresh run) and its step.
  std::string resumed_from;
  int64_t resumed_step = 0;
  // The folder's checkpoints are not this run's: move them aside instead of refusing
  // (checkpoint.start_over). Ignored when the run continues the folder's own checkpoints.
  bool start_over = false;
  // Who the run is ("job j-17" for daemon job j-17), written to `<dir>/OWNER` when the run
  // starts the folder (it does not continue the folder's checkpoints); empty: "pid P on
  // host H". A restarted daemon job continues a folder only if it is the owner.
  std::string owner;
};

// The folder held for one run: the lock and what was done to the folder (for the log).
struct CheckpointFolderClaim {
  base::FolderLock lock;
  std::vector<std::string> notes;
};

// Makes `dir` this run's checkpoint folder before the first step; call on the one process
// that writes checkpoints (rank 0). Creates it; refuses a path that is a file or not
// writable (errno named); takes the folder lock (refused with the holder's pid and host);
// removes stale `step-*.ckpt.tmp-PID` files of dead writers; then
//  - a fresh run into a folder holding checkpoints is refused (FailedPrecondition saying
//    how to continue or start over), or with start_over they move to previous-<time>/;
//  - a run resuming from a checkpoint in `dir` continues it: checkpoints newer than the
//    resumed step (an abandoned continuation) move to superseded-<time>/;
//  - a run resuming from elsewhere is a fresh run as far as `dir` is concerned.
absl::StatusOr<CheckpointFolderClaim> ClaimCheckpointFolder(const std::string& dir,
                                                            const CheckpointFolderRun& run);

// The owner recorded in `<dir>/OWNER` by the run that started the folder; NotFound when
// none did (an empty folder, or one written before owners were recorded).
absl::StatusOr<std::string> CheckpointFolderOwner(const std::string& dir);

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_CHECKPOINT_H_
