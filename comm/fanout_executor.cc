#include "comm/fanout_executor.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/progress.h"

namespace rackrun::comm {
namespace {

// What every rank derives from the schedule: roles, relay depths and tags.
struct ScheduleRoles {
  std::map<int, int> origin;  // expert -> origin rank
  std::map<int, int> tag;     // expert -> message tag
  std::vector<int> depth;     // per transfer: 0 from the origin, k+1 from a depth-k relay
  std::map<std::pair<int, int>, int> incoming;  // (expert, dst) -> transfer index
  int max_depth = 0;
};

absl::StatusOr<ScheduleRoles> DeriveRoles(const planner::FanoutSchedule& schedule, int ranks,
                                          int tag_base) {
  ScheduleRoles roles;
  const auto& transfers = schedule.transfers;
  std::map<int, std::vector<int>> senders;  // expert -> sending ranks
  for (size_t t = 0; t < transfers.size(); ++t) {
    const planner::WeightTransfer& w = transfers[t];
    if (w.expert < 0 || w.src_rank < 0 || w.src_rank >= ranks || w.dst_rank < 0 ||
        w.dst_rank >= ranks || w.src_rank == w.dst_rank) {
      return absl::InvalidArgumentError(
          absl::StrCat("fan-out schedule transfer ", t, " (expert ", w.expert, ", rank ",
                       w.src_rank, " -> rank ", w.dst_rank,
                       ") needs an expert >= 0 and two different ranks in [0, ", ranks, ")"));
    }
    if (!roles.incoming.emplace(std::make_pair(w.expert, w.dst_rank), static_cast<int>(t)).second) {
      return absl::InvalidArgumentError(absl::StrCat("fan-out schedule sends expert ", w.expert,
                                                     " to rank ", w.dst_rank,
                                                     " twice; each replica is delivered once"));
    }
    senders[w.expert].push_back(w.src_rank);
  }
  for (auto& [expert, ranks_sending] : senders) {
    std::sort(ranks_sending.begin(), ranks_sending.end());
    ranks_sending.erase(std::unique(ranks_sending.begin(), ranks_sending.end()),
                        ranks_sending.end());
    std::vector<int> origins;
    for (int r : ranks_sending) {
      if (!roles.incoming.contains({expert, r})) origins.push_back(r);
    }
    if (origins.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("fan-out schedule: expert ", expert, " has ", origins.size(),
                       " origin ranks (senders that receive nothing) [",
                       absl::StrJoin(origins, ", "), "]; it needs exactly one, its master"));
    }
    roles.origin[expert] = origins.front();
    roles.tag[expert] = tag_base + static_cast<int>(roles.tag.size());
  }
  // Depth: follow each transfer's sender back to the origin; a walk longer than the
  // schedule means a cycle that never reaches the origin.
  roles.depth.assign(transfers.size(), 0);
  for (size_t t = 0; t < transfers.size(); ++t) {
    int depth = 0;
    int sender = transfers[t].src_rank;
    const int expert = transfers[t].expert;
    while (sender != roles.origin[expert]) {
      const int in = roles.incoming.at({expert, sender});
      sender = transfers[static_cast<size_t>(in)].src_rank;
      if (++depth > static_cast<int>(transfers.size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fan-out schedule: expert ", expert,
            " is forwarded in a cycle that never reaches its origin rank ", roles.origin[expert]));
      }
    }
    roles.depth[t] = depth;
    roles.max_depth = std::max(roles.max_depth, depth);
  }
  return roles;
}

struct Chunking {
  int64_t total = 0;
  int64_t chunk = 0;
  int64_t count() const { return total == 0 ? 0 : (total + chunk - 1) / chunk; }
  int64_t offset(int64_t c) const { return c * chunk; }
  int64_t size(int64_t c) const { return std::min(chunk, total - c * chunk); }
};

// One chunk in flight, for progress and for the timeout message.
struct ChunkRequest {
  std::unique_ptr<Request> request;
  int expert = -1;
  int64_t chunk = 0;
};

std::string Pending(const ChunkRequest& r, int64_t chunks) {
  const RequestInfo& info = r.request->info();
  return absl::StrCat("rank ", info.peer, " (expert ", r.expert, " chunk ", r.chunk, "/", chunks,
                      info.send ? ", send)" : ", recv)");
}

absl::Status Timeout(const DataChannel& channel, absl::Duration waited,
                     const std::vector<std::string>& pending) {
  const size_t shown = std::min<size_t>(pending.size(), 4);
  return absl::DeadlineExceededError(absl::StrCat(
      "FanoutExecutor on rank ", channel.rank(), " of ", channel.size(), " timed out after ",
      absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))), " waiting for ",
      absl::StrJoin(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
      pending.size() > shown ? absl::StrCat(" and ", pending.size() - shown, " more") : "",
      "; that rank is dead, stuck, or not running this fan-out"));
}

class FanoutRun {
 public:
  FanoutRun(DataChannel& channel, const planner::FanoutSchedule& schedule, ScheduleRoles roles,
            const Chunking& chunking, const std::map<int, std::span<std::byte>>& buffers)
      : channel_(channel),
        schedule_(schedule),
        roles_(std::move(roles)),
        chunking_(chunking),
        buffers_(buffers),
        me_(channel.rank()) {}

  // Eager pacing in three steps: Post posts every receive and the origin's sends; Poll
  // completes what arrived and forwards it at relays; Wait polls until done.
  absl::Status Post();
  absl::StatusOr<bool> Poll();
  absl::Status Wait(absl::Time deadline);
  absl::Status Rounds(absl::Time deadline);
  const FanoutExecutorStats& stats() const { return stats_; }

 private:
  absl::StatusOr<ChunkRequest> PostSend(const planner::WeightTransfer& w, int64_t c) {
    std::byte* base = buffers_.at(w.expert).data();
    absl::StatusOr<std::unique_ptr<Request>> r =
        channel_.Isend(base + chunking_.offset(c), chunking_.size(c), DataType::kByte, w.dst_rank,
                       roles_.tag.at(w.expert));
    if (!r.ok()) return r.status();
    stats_.bytes_sent += chunking_.size(c);
    ++stats_.chunks_sent;
    return ChunkRequest{*std::move(r), w.expert, c};
  }
  absl::StatusOr<ChunkRequest> PostRecv(const planner::WeightTransfer& w, int64_t c) {
    std::byte* base = buffers_.at(w.expert).data();
    absl::StatusOr<std::unique_ptr<Request>> r =
        channel_.Irecv(base + chunking_.offset(c), chunking_.size(c), DataType::kByte, w.src_rank,
                       roles_.tag.at(w.expert));
    if (!r.ok()) return r.status();
    stats_.bytes_received += chunking_.size(c);
    return ChunkRequest{*std::move(r), w.expert, c};
  }

  DataChannel& channel_;
  const planner::FanoutSchedule schedule_;  // copies: a started fan-out outlives its caller's
  const ScheduleRoles roles_;
  Chunking chunking_;
  const std::map<int, std::span<std::byte>> buffers_;
  int me_;
  FanoutExecutorStats stats_;

  // Eager pacing's state between Post and done.
  struct Incoming {
    std::vector<ChunkRequest> chunks;
    int64_t arrived = 0;  // chunks [0, arrived) are complete
  };
  std::map<int, Incoming> incoming_;
  struct Forward {
    size_t transfer;  // index into schedule_.transfers
    int64_t next = 0;
  };
  std::vector<Forward> forwards_;
  std::vector<ChunkRequest> sends_;
  bool progressed_ = false;  // the last Poll completed or posted something
};

absl::Status FanoutRun::Post() {
  const int64_t chunks = chunking_.count();
  // Receives: every chunk of every expert this rank receives, posted up front.
  for (const planner::WeightTransfer& w : schedule_.transfers) {
    if (w.dst_rank != me_) continue;
    Incoming& in = incoming_[w.expert];
    for (int64_t c = 0; c < chunks; ++c) {
      absl::StatusOr<ChunkRequest> r = PostRecv(w, c);
      if (!r.ok()) return r.status();
      in.chunks.push_back(*std::move(r));
    }
  }
  // Sends: the origin sends everything now; a relay forwards as chunks arrive.
  for (size_t t = 0; t < schedule_.transfers.size(); ++t) {
    const planner::WeightTransfer& w = schedule_.transfers[t];
    if (w.src_rank != me_) continue;
    if (roles_.origin.at(w.expert) == me_) {
      for (int64_t c = 0; c < chunks; ++c) {
        absl::StatusOr<ChunkRequest> r = PostSend(w, c);
        if (!r.ok()) return r.status();
        sends_.push_back(*std::move(r));
      }
    } else {
      forwards_.push_back({t});
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> FanoutRun::Poll() {
  const int64_t chunks = chunking_.count();
  bool progressed = false;
  bool receiving = false;
  for (auto& [expert, in] : incoming_) {
    while (in.arrived < chunks) {
      absl::StatusOr<bool> done = in.chunks[static_cast<size_t>(in.arrived)].request->Test();
      if (!done.ok()) return done.status();
      if (!*done) break;
      ++in.arrived;
      progressed = true;
    }
    receiving |= in.arrived < chunks;
  }
  bool forwarding = false;
  for (Forward& f : forwards_) {
    const planner::WeightTransfer& w = schedule_.transfers[f.transfer];
    const int64_t arrived = incoming_.at(w.expert).arrived;
    while (f.next < arrived) {
      absl::StatusOr<ChunkRequest> r = PostSend(w, f.next++);
      if (!r.ok()) return r.status();
      sends_.push_back(*std::move(r));
      progressed = true;
    }
    forwarding |= f.next < chunks;
  }
  size_t kept = 0;
  for (size_t i = 0; i < sends_.size(); ++i) {
    absl::StatusOr<bool> done = sends_[i].request->Test();
    if (!done.ok()) return done.status();
    if (*done) {
      progressed = true;
    } else {
      sends_[kept++] = std::move(sends_[i]);
    }
  }
  sends_.resize(kept);
  progressed_ = progressed;
  return !receiving && !forwarding && sends_.empty();
}

absl::Status FanoutRun::Wait(absl::Time deadline) {
  const absl::Time start = absl::Now();
  const int64_t chunks = chunking_.count();
  ProgressBackoff backoff(channel_.completion_event());
  while (true) {
    backoff.StartPass();
    absl::StatusOr<bool> done = Poll();
    if (!done.ok()) return done.status();
    if (*done) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      std::vector<std::string> pending;
      for (const auto& [expert, in] : incoming_) {
        if (in.arrived < chunks) pending.push_back(Pending(in.chunks[in.arrived], chunks));
      }
      for (const ChunkRequest& s : sends_) pending.push_back(Pending(s, chunks));
      return Timeout(channel_, absl::Now() - start, pending);
    }
    if (progressed_) {
      backoff.Progress();
    } else {
      backoff.Idle(deadline);
    }
  }
}

absl::Status FanoutRun::Rounds(absl::Time deadline) {
  const absl::Time start = absl::Now();
  const int64_t chunks = chunking_.count();
  const int64_t rounds = chunks == 0 ? 0 : chunks + roles_.max_depth;
  for (int64_t round = 0; round < rounds; ++round) {
    std::vector<ChunkRequest> posted;
    if (absl::Status s = channel_.GroupStart(); !s.ok()) return s;
    // Schedule order on both ends of every pair: the order untagged transports match in.
    for (size_t t = 0; t < schedule_.transfers.size(); ++t) {
      const planner::WeightTransfer& w = schedule_.transfers[t];
      const int64_t c = round - roles_.depth[t];
      if (c < 0 || c >= chunks) continue;
      if (w.dst_rank == me_) {
        absl::StatusOr<ChunkRequest> r = PostRecv(w, c);
        if (!r.ok()) return r.status();
        posted.push_back(*std::move(r));
      }
      if (w.src_rank == me_) {
        absl::StatusOr<ChunkRequest> r = PostSend(w, c);
        if (!r.ok()) return r.status();
        posted.push_back(*std::move(r));
      }
    }
    if (absl::Status s = channel_.GroupEnd(); !s.ok()) return s;
    ProgressBackoff backoff(channel_.completion_event());
    while (true) {
      backoff.StartPass();
      bool all = true;
      bool progressed = false;
      for (ChunkRequest& r : posted) {
        if (r.request == nullptr) continue;
        absl::StatusOr<bool> done = r.request->Test();
        if (!done.ok()) return done.status();
        if (*done) {
          r.request.reset();
          progressed = true;
        } else {
          all = false;
        }
      }
      if (all) break;
      if (absl::Now() >= deadline) {
        std::vector<std::string> pending;
        for (const ChunkRequest& r : posted) {
          if (r.request != nullptr) pending.push_back(Pending(r, chunks));
        }
        return Timeout(channel_, absl::Now() - start, pending);
      }
      if (progressed) {
        backoff.Progress();
      } else {
        backoff.Idle(deadline);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct FanoutInFlight::State {
  State(DataChannel& channel, const planner::FanoutSchedule& schedule, ScheduleRoles roles,
        const Chunking& chunking, const std::map<int, std::span<std::byte>>& buffers,
        absl::Time start_in)
      : run(channel, schedule, std::move(roles), chunking, buffers),
        start(start_in),
        timeout(channel.timeout()) {}
  FanoutRun run;
  absl::Time start;
  absl::Duration timeout;
  bool done = false;
};

FanoutInFlight::FanoutInFlight(std::unique_ptr<State> state) : state_(std::move(state)) {}
FanoutInFlight::~FanoutInFlight() = default;

absl::StatusOr<bool> FanoutInFlight::Poll() {
  if (state_->done) return true;
  absl::StatusOr<bool> done = state_->run.Poll();
  if (done.ok() && *done) state_->done = true;
  return done;
}

absl::StatusOr<FanoutExecutorStats> FanoutInFlight::Finish() {
  if (!state_->done) {
    if (absl::Status s = state_->run.Wait(absl::Now() + state_->timeout); !s.ok()) return s;
    state_->done = true;
  }
  FanoutExecutorStats stats = state_->run.stats();
  stats.elapsed = absl::Now() - state_->start;
  return stats;
}

absl::StatusOr<std::unique_ptr<FanoutInFlight>> StartFanout(
    DataChannel& channel, const planner::FanoutSchedule& schedule, int64_t expert_bytes,
    const std::map<int, std::span<std::byte>>& buffers, const FanoutExecutorOptions& options) {
  const absl::Time start = absl::Now();
  if (expert_bytes < 0 || options.chunk_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ExecuteFanout: expert_bytes=", expert_bytes, " chunk_bytes=", options.chunk_bytes,
        "; expert_bytes must be >= 0 and chunk_bytes >= 1 (e.g. 262144)"));
  }
  absl::StatusOr<ScheduleRoles> roles = DeriveRoles(schedule, channel.size(), options.tag_base);
  if (!roles.ok()) return roles.status();
  const int me = channel.rank();
  for (const planner::WeightTransfer& w : schedule.transfers) {
    if (w.src_rank != me && w.dst_rank != me) continue;
    auto it = buffers.find(w.expert);
    if (it == buffers.end() || static_cast<int64_t>(it->second.size()) != expert_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("ExecuteFanout on rank ", me, ": buffers[expert ", w.expert, "] ",
                       it == buffers.end() ? std::string("is missing")
                                           : absl::StrCat("has ", it->second.size(), " bytes"),
                       "; this rank ", w.src_rank == me ? "sends" : "receives",
                       " that expert and needs expert_bytes = ", expert_bytes));
    }
  }
  FanoutPacing pacing = options.pacing;
  if (pacing == FanoutPacing::kAuto) {
    pacing = channel.matches_by_tag() ? FanoutPacing::kEager : FanoutPacing::kRounds;
  }
  if (pacing == FanoutPacing::kEager && !channel.matches_by_tag()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ExecuteFanout: eager pacing needs tag matching, which the ",
                     channel.backend(), " channel lacks; use FanoutPacing::kRounds or kAuto"));
  }
  auto state = std::make_unique<FanoutInFlight::State>(channel, schedule, *std::move(roles),
                                                       Chunking{expert_bytes, options.chunk_bytes},
                                                       buffers, start);
  if (pacing == FanoutPacing::kEager) {
    if (absl::Status s = state->run.Post(); !s.ok()) return s;
  } else {
    if (absl::Status s = state->run.Rounds(start + channel.timeout()); !s.ok()) return s;
    state->done = true;
  }
  return std::make_unique<FanoutInFlight>(std::move(state));
}

absl::StatusOr<FanoutExecutorStats> ExecuteFanout(
    DataChannel& channel, const planner::FanoutSchedule& schedule, int64_t expert_bytes,
    const std::map<int, std::span<std::byte>>& buffers, const FanoutExecutorOptions& options) {
  absl::StatusOr<std::unique_ptr<FanoutInFlight>> run =
      StartFanout(channel, schedule, expert_bytes, buffers, options);
  if (!run.ok()) return run.status();
  return (*run)->Finish();
}

}  // namespace rackrun::comm
