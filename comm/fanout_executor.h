// FanoutExecutor: carries out a planner::FanoutSchedule over a data channel (docs/design.md
// section 3.9). Each transfer streams an expert's weight bytes in chunks; a relay forwards
// chunk c to its leaves as soon as chunk c has arrived. There is no barrier between
// stages and none between ranks: every rank waits only for its own transfers.
//
// Roles follow from the schedule alone: for each expert, the one rank that sends it but
// never receives it is its origin (the master); every destination receives it exactly
// once; a destination that also sends it is a relay and forwards what it receives.
//
// Two forms: ExecuteFanout blocks until this rank's part is done; StartFanout posts it and
// returns, so that the caller can compute (or run other collectives) while the weights
// travel, and completes it later with FanoutInFlight::Finish.
#ifndef RACKRUN_COMM_RELAY_FANOUT_H_
#define RACKRUN_COMM_RELAY_FANOUT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/data_channel.h"
#include "planner/plan.h"

namespace rackrun::comm {

enum class FanoutPacing {
  // kEager on channels that match messages by tag, kRounds otherwise (NCCL).
  kAuto,
  // Every receive and every origin send is posted at once; a relay forwards chunk c the
  // moment chunk c has arrived (tags keep experts apart).
  kEager,
  // Software pipeline in rounds: in round r a transfer at relay depth k moves chunk
  // r - k, so a relay forwards chunk c one round after receiving it. Each rank posts its
  // round's messages as one group, in schedule order, and waits only for them: both ends
  // of every pair post in the same order, which untagged transports (NCCL) need.
  kRounds,
};

struct FanoutExecutorOptions {
  int64_t chunk_bytes = 256 << 10;
  FanoutPacing pacing = FanoutPacing::kAuto;
  // Point-to-point tags used: [tag_base, tag_base + experts in the schedule).
  int tag_base = 0;
};

struct FanoutExecutorStats {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t chunks_sent = 0;
  absl::Duration elapsed;
};

// Runs this rank's part of `schedule`; every rank of `channel` must call it with the same
// schedule, expert_bytes and options. `buffers` maps each expert this rank sends or
// receives to its weights: on the origin, the bytes to send; on a destination, the buffer
// that receives them (a relay forwards from it). Each has expert_bytes bytes.
//
// InvalidArgument if the schedule is malformed (rank out of range, self-transfer, an
// expert with no single origin, a rank receiving an expert twice) or a buffer is missing
// or has the wrong size. DeadlineExceeded after the channel's timeout names this rank,
// the expert, the chunk and the peer still waited for.
// A fan-out this rank has posted and not yet completed (StartFanout). Single-threaded.
// Destroying it before Finish abandons this rank's part (its receives are cancelled); the
// peers then time out, so do that only on the way to stopping the job.
class FanoutInFlight {
 public:
  struct State;
  explicit FanoutInFlight(std::unique_ptr<State> state);
  ~FanoutInFlight();
  FanoutInFlight(const FanoutInFlight&) = delete;
  FanoutInFlight& operator=(const FanoutInFlight&) = delete;

  // Non-blocking: completes what has arrived and lets relays forward the chunks they have.
  // True when this rank's part is done.
  absl::StatusOr<bool> Poll();
  // Blocks until this rank's part is done. DeadlineExceeded after the channel's timeout
  // (counted from this call) as ExecuteFanout; stats.elapsed runs from StartFanout.
  absl::StatusOr<FanoutExecutorStats> Finish();

 private:
  std::unique_ptr<State> state_;
};

// Posts this rank's part of `schedule` and returns (eager pacing: every receive and every
// origin send is posted now; relays forward in Poll and Finish). With round pacing the
// ranks must post in lockstep, so StartFanout runs the whole fan-out before returning.
// Arguments, errors and the contract as ExecuteFanout; the schedule and the map are copied,
// the buffers they name must stay valid (and the received ones unread) until Finish.
absl::StatusOr<std::unique_ptr<FanoutInFlight>> StartFanout(
    DataChannel& channel, const planner::FanoutSchedule& schedule, int64_t expert_bytes,
    const std::map<int, std::span<std::byte>>& buffers, const FanoutExecutorOptions& options = {});

absl::StatusOr<FanoutExecutorStats> ExecuteFanout(
    DataChannel& channel, const planner::FanoutSchedule& schedule, int64_t expert_bytes,
    const std::map<int, std::span<std::byte>>& buffers, const FanoutExecutorOptions& options = {});

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_RELAY_FANOUT_H_
