#include "coordinator/failure_detector.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rackrun::coordinator {

using rackrun::v1::Failure;
using rackrun::v1::FailureKind;
using rpc::Phase;

namespace {

constexpr double kMsPerSecond = 1000.0;

bool Silent(const RankSnapshot& w, int64_t now_ms, const DetectionTimeouts& t) {
  return now_ms - w.last_heartbeat_ms > t.heartbeat_timeout_ms;
}

// Late: its heartbeats are behind by more than a missed heartbeat explains, but it is not
// silent yet (see the header comment).
bool Late(const RankSnapshot& w, int64_t now_ms, const DetectionTimeouts& t) {
  return now_ms - w.last_heartbeat_ms > t.late_after_ms && !Silent(w, now_ms, t);
}

bool AnyLate(const AttemptSnapshot& attempt, int64_t now_ms, const DetectionTimeouts& t) {
  return std::any_of(attempt.ranks.begin(), attempt.ranks.end(),
                     [&](const RankSnapshot& w) { return Late(w, now_ms, t); });
}

// No verdict yet, and none may come from a later rule (a function: Ruling holds a protobuf
// message, so it is no literal type, and clang refuses it as constexpr).
Ruling Hold() { return Ruling{true, std::nullopt}; }

// How long the rank has been in its phase: its reported age plus the time since then.
int64_t PhaseAge(const RankSnapshot& w, int64_t now_ms) {
  return w.phase_age_ms + (now_ms - w.last_heartbeat_ms);
}

Failure FailureOf(const RankSnapshot& w, FailureKind kind, std::string message, int64_t now_ms) {
  Failure f;
  f.set_kind(kind);
  f.set_rank(w.rank);
  f.set_worker_id(w.worker_id);
  f.set_host(w.host);
  f.set_pid(w.pid);
  f.set_phase(w.phase_name);
  f.set_step(w.step);
  f.set_message(std::move(message));
  f.set_time_unix_ms(now_ms);
  return f;
}

// A failure naming no single rank, in `phase` (the step is the first rank's).
Failure NoRankFailure(const AttemptSnapshot& attempt, FailureKind kind, std::string message,
                      Phase phase, int64_t now_ms) {
  Failure f = FailureOf(attempt.ranks.front(), kind, std::move(message), now_ms);
  f.set_rank(-1);
  f.clear_worker_id();
  f.clear_host();
  f.set_pid(0);
  f.set_phase(rpc::PhaseName(phase));
  return f;
}

Ruling Found(Failure f) { return Ruling{true, std::move(f)}; }

}  // namespace

StreamState StreamStateOf(const RankSnapshot& w, int64_t now_ms, const DetectionTimeouts& t) {
  if (!w.stream_seen || w.stream_open) return StreamState::kOpen;
  // A heartbeat after the close proves the process lives (it reconnects after a partition,
  // or its connection died under it).
  const int64_t silence = w.stream_closed_ms - w.last_heartbeat_ms;
  if (silence < 0 || silence > std::min(t.exit_window_ms, t.heartbeat_timeout_ms)) {
    return StreamState::kDroppedSilent;
  }
  // Closed while it heartbeated: an exit once the heartbeats are late (or silent), not
  // before (a live worker heartbeats within late_after).
  return now_ms - w.last_heartbeat_ms > std::min(t.late_after_ms, t.heartbeat_timeout_ms)
             ? StreamState::kExited
             : StreamState::kClosing;
}

Ruling LostStreamRule(const AttemptSnapshot& attempt, int64_t now_ms, const DetectionTimeouts& t) {
  // Several closed streams: the first by worker id (the order Workers keeps them in).
  const RankSnapshot* lost = nullptr;
  for (const RankSnapshot& w : attempt.ranks) {
    if (StreamStateOf(w, now_ms, t) == StreamState::kExited &&
        (lost == nullptr || w.worker_id < lost->worker_id)) {
      lost = &w;
    }
  }
  if (lost == nullptr) return {};
  return Found(FailureOf(
      *lost, rackrun::v1::WORKER_LOST,
      "its connection to the coordinator closed (the process exited or was killed)", now_ms));
}

Ruling CollectiveHangRule(const AttemptSnapshot& attempt, int64_t now_ms,
                          const DetectionTimeouts& t) {
  const auto& ranks = attempt.ranks;
  int64_t n = 0;  // the collective the peers wait in
  int64_t longest_ms = 0;
  std::vector<int> waiting;
  for (const RankSnapshot& w : ranks) {
    if (Silent(w, now_ms, t) || w.blocked_n == 0) continue;
    const int64_t blocked_ms = now_ms - w.blocked_since_ms;
    if (blocked_ms > t.hang_timeout_ms) {
      n = std::max(n, w.blocked_n);
      longest_ms = std::max(longest_ms, blocked_ms);
      waiting.push_back(w.rank);
    }
  }
  if (n == 0) return {};
  const RankSnapshot* culprit = nullptr;
  std::string why;
  for (const RankSnapshot& w : ranks) {
    if (!Silent(w, now_ms, t)) continue;
    const StreamState stream = StreamStateOf(w, now_ms, t);
    if (stream == StreamState::kExited) continue;
    culprit = &w;
    why = absl::StrCat(
        "its heartbeats stopped ", (now_ms - w.last_heartbeat_ms) / kMsPerSecond, " s ago ",
        stream == StreamState::kOpen
            ? "while its connection stays open (stopped or stuck process)"
            : absl::StrCat("and its connection was dropped ",
                           (w.stream_closed_ms - w.last_heartbeat_ms) / kMsPerSecond,
                           " s later for not answering keepalive pings (stopped, stuck or "
                           "unreachable process)"));
    break;
  }
  // No rank is silent, and one is late: what it last said may be out of date (a link
  // that was cut for a moment); it reports again or falls silent soon.
  if (culprit == nullptr && AnyLate(attempt, now_ms, t)) return Hold();
  bool transport = false;  // every rank the waiters wait for waits in a collective itself
  if (culprit == nullptr) {
    for (const RankSnapshot& w : ranks) {
      if (w.entered < n && (culprit == nullptr || w.entered < culprit->entered)) culprit = &w;
    }
    if (culprit != nullptr) {
      why = absl::StrCat("it has entered only ", culprit->entered, " collectives");
      if (culprit->blocked_n != 0) {
        // It heartbeats and waits in collective `entered` itself: it is past its compute,
        // and the data its collective waits for has been sent by ranks that completed it.
        // That data is in flight: a link that was cut retransmits with TCP's backoff.
        transport = true;
        absl::StrAppend(&why, " and has waited in collective ", culprit->blocked_n, " for ",
                        (now_ms - culprit->blocked_since_ms) / kMsPerSecond,
                        " s itself (the data its peers sent it has not arrived: a link down or "
                        "retransmitting for that long)");
      }
    }
  }
  // Every rank has entered collective n and none is silent yet, or the rank behind waits
  // in a collective of its own: the waits are the network's (data in flight, retransmitted
  // with backoff after a short cut) or a rank stopped inside the collective, which looks
  // the same until its heartbeats are overdue. So wait for heartbeat_timeout more before
  // naming: by then a stopped rank is silent and named above, and data held up by a cut
  // the heartbeats survived has arrived (failure-model.md, the cut bound).
  if ((culprit == nullptr || transport) &&
      longest_ms <= t.hang_timeout_ms + t.heartbeat_timeout_ms) {
    return Hold();
  }
  const std::string peers =
      absl::StrCat("rank(s) ", absl::StrJoin(waiting, ", "), " wait in collective ", n, " for ",
                   longest_ms / kMsPerSecond, " s");
  if (culprit != nullptr) {
    return Found(FailureOf(*culprit, rackrun::v1::HANG, absl::StrCat(peers, "; ", why), now_ms));
  }
  return Found(NoRankFailure(attempt, rackrun::v1::HANG,
                             absl::StrCat(peers, "; every rank is in it (no single rank behind)"),
                             Phase::kCollective, now_ms));
}

Ruling LostSilenceRule(const AttemptSnapshot& attempt, int64_t now_ms, const DetectionTimeouts& t) {
  // A peer blocked in a collective waits for the silent rank: that is hang (a)'s to judge.
  for (const RankSnapshot& w : attempt.ranks) {
    if (!Silent(w, now_ms, t) && w.blocked_n != 0) return {};
  }
  for (const RankSnapshot& w : attempt.ranks) {
    if (Silent(w, now_ms, t)) {
      return Found(FailureOf(
          w, rackrun::v1::WORKER_LOST,
          absl::StrCat("no heartbeat for ", (now_ms - w.last_heartbeat_ms) / kMsPerSecond,
                       " s (heartbeat timeout ", t.heartbeat_timeout_ms / kMsPerSecond, " s)"),
          now_ms));
    }
  }
  return {};
}

Ruling RendezvousHangRule(const AttemptSnapshot& attempt, int64_t now_ms,
                          const DetectionTimeouts& t) {
  // Ranks waiting for their peers in the data channel's rendezvous are victims: when they
  // have waited past hang_timeout, the rule names the rank they wait for (the one not in
  // the rendezvous, longest in its phase), or no single rank when every rank is in it.
  // A rank still starting is waited for up to the start timeout.
  // A rank that has entered a collective is past the rendezvous, and so are the others:
  // one still reported "connecting" has not sent a heartbeat since (or is stuck in its own
  // connect, and the peers blocked in their first collective are hang (a)'s to judge).
  for (const RankSnapshot& w : attempt.ranks) {
    if (w.entered > 0 || w.blocked_n != 0) return {};
  }
  const RankSnapshot* awaited = nullptr;
  int64_t awaited_ms = -1;
  for (const RankSnapshot& w : attempt.ranks) {
    const int64_t age = PhaseAge(w, now_ms);
    if (w.phase != Phase::kConnecting && w.phase != Phase::kCollective && w.blocked_n == 0 &&
        !Silent(w, now_ms, t) && age > awaited_ms) {
      awaited = &w;
      awaited_ms = age;
    }
  }
  // Every rank in the rendezvous: they wait for the coordinator's store and each other's
  // connections, not for a rank, so (as hang (a) with every rank in the collective) the
  // heartbeat timeout is added: a cut link delays the store's answers and the channel's
  // connections by TCP's backoff.
  const int64_t rendezvous_timeout = awaited == nullptr ? t.hang_timeout_ms + t.heartbeat_timeout_ms
                                     : awaited->phase == Phase::kStarting ? t.start_timeout_ms
                                                                          : t.hang_timeout_ms;
  std::vector<int> connecting;
  int64_t connecting_ms = 0;
  for (const RankSnapshot& w : attempt.ranks) {
    const int64_t age = PhaseAge(w, now_ms);
    if (w.phase == Phase::kConnecting && age > rendezvous_timeout) {
      connecting.push_back(w.rank);
      connecting_ms = std::max(connecting_ms, age);
    }
  }
  if (connecting.empty()) return {};
  if (AnyLate(attempt, now_ms, t)) return Hold();  // what a late rank last said may be out of date
  const std::string waiters = absl::StrCat("rank(s) ", absl::StrJoin(connecting, ", "),
                                           " wait in the data channel's rendezvous for ",
                                           connecting_ms / kMsPerSecond, " s");
  if (awaited != nullptr) {
    const std::string phase =
        awaited->phase_name.empty() ? rpc::PhaseName(Phase::kIdle) : awaited->phase_name;
    return Found(FailureOf(*awaited, rackrun::v1::HANG,
                           absl::StrCat(waiters, " for it; it has been in phase ", phase, " for ",
                                        awaited_ms / kMsPerSecond, " s"),
                           now_ms));
  }
  return Found(NoRankFailure(attempt, rackrun::v1::HANG,
                             absl::StrCat(waiters,
                                          "; every rank is in it (check that the ranks can reach "
                                          "each other's data addresses)"),
                             Phase::kConnecting, now_ms));
}

Ruling PhaseHangRule(const AttemptSnapshot& attempt, int64_t now_ms, const DetectionTimeouts& t) {
  for (const RankSnapshot& w : attempt.ranks) {
    if (w.phase == Phase::kIdle || w.phase == Phase::kCollective || w.phase == Phase::kConnecting ||
        w.blocked_n != 0 || Silent(w, now_ms, t) || Late(w, now_ms, t)) {
      continue;
    }
    if (w.phase == Phase::kReporting) {
      // The rank's training is over and its result on the way, which may have waited for
      // this coordinator (restarting) or its own progress reports: counted from the
      // rank's (re-)registration here at the latest and allowed kReportingTimeouts hang
      // timeouts, so only a teardown or report stuck for good is a hang.
      const int64_t age = std::min(PhaseAge(w, now_ms), now_ms - w.registered_ms);
      if (age > kReportingTimeouts * t.hang_timeout_ms) {
        return Found(FailureOf(
            w, rackrun::v1::HANG,
            absl::StrCat("in phase reporting (training over, result not "
                         "delivered) for ",
                         age / kMsPerSecond, " s (", kReportingTimeouts, " x the hang timeout of ",
                         t.hang_timeout_ms / kMsPerSecond, " s)"),
            now_ms));
      }
      continue;
    }
    const int64_t age = PhaseAge(w, now_ms);
    // Starting (paths, memory check, model, data) is judged by a timeout of its own: it
    // grows with the model and the machine's load, not with a step.
    const bool starting = w.phase == Phase::kStarting;
    const int64_t timeout = starting ? t.start_timeout_ms : t.hang_timeout_ms;
    if (age > timeout) {
      return Found(FailureOf(
          w, rackrun::v1::HANG,
          absl::StrCat("in phase ", w.phase_name, " for ", age / kMsPerSecond, " s (",
                       starting ? "start" : "hang", " timeout ", timeout / kMsPerSecond, " s)"),
          now_ms));
    }
  }
  return {};
}

std::optional<Finding> DetectFailure(const AttemptSnapshot& attempt, int64_t now_ms,
                                     const DetectionTimeouts& timeouts) {
  if (attempt.ranks.empty()) return std::nullopt;
  using Rule = Ruling (*)(const AttemptSnapshot&, int64_t, const DetectionTimeouts&);
  static constexpr std::pair<DetectionRule, Rule> kRules[] = {
      {DetectionRule::kLostStream, &LostStreamRule},
      {DetectionRule::kCollectiveHang, &CollectiveHangRule},
      {DetectionRule::kLostSilence, &LostSilenceRule},
      {DetectionRule::kRendezvousHang, &RendezvousHangRule},
      {DetectionRule::kPhaseHang, &PhaseHangRule},
  };
  for (const auto& [rule, judge] : kRules) {
    Ruling r = judge(attempt, now_ms, timeouts);
    if (!r.decided) continue;
    if (!r.failure.has_value()) return std::nullopt;
    return Finding{attempt.job_id, attempt.attempt, std::move(*r.failure), rule};
  }
  return std::nullopt;
}

}  // namespace rackrun::coordinator
