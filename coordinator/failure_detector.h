// Failure detection: the rules that name the culprit of a failed attempt, not a victim.
//
// Workers::Detect (workers.h) takes a read-only snapshot of the busy workers of one running
// attempt (AttemptSnapshot) and asks DetectFailure, which asks the rules below in this order
// and returns at most one finding per running attempt:
//   lost  the worker's Assignments stream closed while it was heartbeating (its process
//         died: the kernel closed the connection; the last heartbeat came at most
//         exit_window before the close) and no heartbeat followed for late_after (a live
//         worker whose connection died under it, e.g. data left unacknowledged through a
//         cut for the keepalive timeout, goes on heartbeating over its other connection
//         and opens a new stream: a close is no exit until the heartbeats confirm it), or
//         no heartbeat for heartbeat_timeout while no
//         peer of its attempt waits for it in a collective -> WORKER_LOST naming it. A
//         stream that closed only after a longer silence was dropped by gRPC keepalive
//         because one side stopped answering: the coordinator's keepalive for a stopped
//         worker (its timeout exceeds heartbeat_timeout: server.cc), or the worker's own
//         keepalive (rpc/liveness.h: at least 20 s and 2 x heartbeat_timeout without an
//         answer) during a network partition, whose close the coordinator sees when the
//         link is back. That is no proof of exit: the rank counts as silent, as if its stream
//         were open, and is judged by its heartbeats (tests/netns:
//         CoordinatorCutsBelowTheBoundFailNothingAndOneWellAboveIsNamed).
//   hang  (a) peers of its attempt have been blocked in collective n (entered = n >
//         completed) for longer than hang_timeout while it reports entered < n, or its
//         heartbeats stopped while its stream stays open or was dropped only after they
//         stopped (SIGSTOP) -> HANG naming it
//         (when several qualify: the one furthest behind, then the lowest rank); when
//         every rank has entered n and none is silent, HANG naming no rank, after
//         hang_timeout + heartbeat_timeout (a rank stopped inside the collective is
//         silent by then, and named). The rank behind that itself waits in a collective
//         (it heartbeats, blocked in collective entered < n) is past its compute and waits
//         for data its peers sent: a link that was cut retransmits it with TCP's backoff
//         (up to about twice the cut), so it too is named only after hang_timeout +
//         heartbeat_timeout (the transport hold);
//         (b) it stays in one non-idle phase longer than hang_timeout (start_timeout for
//         phase "starting"; ranks waiting in a collective are victims, never named by
//         this rule) -> HANG naming it; a rank in
//         phase "reporting" (training over, its result on the way, which may have waited
//         for a restarting coordinator) only after 4 x hang_timeout, its age counted from
//         its last (re-)registration at the latest;
//         (c) peers have waited in the data channel's rendezvous (phase "connecting")
//         longer than hang_timeout (start_timeout while the rank they wait for is
//         "starting") while it is in another phase -> HANG naming it (the one longest in
//         its phase); every rank in the rendezvous for hang_timeout + heartbeat_timeout
//         (they wait for the store and the network, as in (a)) -> HANG, no rank named. Not once
//         any rank has entered a collective: the rendezvous is then over, a rank still
//         reported "connecting" sent its last heartbeat before it ended (a rank stuck in
//         its own connect leaves its peers blocked in their first collective: hang (a)).
// Late ranks: a rank whose last heartbeat is older than late_after (the longest gap of a
// worker whose link is fine but whose one heartbeat missed its deadline, rpc/liveness.h)
// but not older than heartbeat_timeout is late: what it last reported may be out of date
// (a link cut for a moment: it reports again within the survivable-cut bound, or falls
// silent and is judged for that). No hang verdict rests on a late rank's report: hang (a)
// beyond a silent rank, and (c), hold while a rank of the attempt is late, and (b) skips
// late ranks.
// Times come from the injected clock; phase ages are the worker's reported age plus the
// time since that heartbeat.
//
// The rules, one function each, asked in this order (the first that decides ends the
// search): LostStreamRule (lost, stream closed), CollectiveHangRule (hang (a)),
// LostSilenceRule (lost, no heartbeat), RendezvousHangRule (hang (c)), PhaseHangRule
// (hang (b)). A rule decides when it names a failure, or when it holds the attempt back
// (hang (a) before it may name no rank): then no later rule is asked this time.
//
// Bookkeeping stays with Workers: which attempts were reported, marking lost workers LOST,
// the lock. The rules read only the snapshot, the clock time and the timeouts.
//
// Thread safety: pure functions.
#ifndef RACKRUN_COORDINATOR_FAILURE_DETECTOR_H_
#define RACKRUN_COORDINATOR_FAILURE_DETECTOR_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "rackrun/v1/job_service.pb.h"
#include "rpc/phase.h"

namespace rackrun::coordinator {

// Which rule found a failure.
enum class DetectionRule : int {
  kLostStream,      // lost: the Assignments stream closed
  kCollectiveHang,  // hang (a)
  kLostSilence,     // lost: no heartbeat while no peer waits for it in a collective
  kRendezvousHang,  // hang (c)
  kPhaseHang,       // hang (b)
};

// A failure Detect() found, for the attempt (job_id, attempt).
struct Finding {
  std::string job_id;
  int attempt = 0;
  rackrun::v1::Failure failure;
  DetectionRule rule = DetectionRule::kLostStream;
};

// One busy worker of the attempt as the coordinator last saw it.
struct RankSnapshot {
  int rank = 0;
  std::string worker_id;
  std::string host;
  int pid = 0;
  std::string phase_name;                // as reported (a Failure's phase and messages keep it)
  rpc::Phase phase = rpc::Phase::kIdle;  // rpc::ParsePhase(phase_name)
  int64_t step = 0;
  int64_t registered_ms = 0;  // its last (re-)registration
  int64_t last_heartbeat_ms = 0;
  int64_t phase_age_ms = 0;  // as reported in the last heartbeat
  int64_t entered = 0;       // collectives entered
  int64_t blocked_n = 0;     // collective it was last seen blocked in (0: none)
  int64_t blocked_since_ms = 0;
  bool stream_seen = false;  // an Assignments stream was opened since registration
  bool stream_open = false;
  int64_t stream_closed_ms = 0;  // when it closed (stream_seen && !stream_open)
};

// The busy workers of one running attempt, in rank order.
struct AttemptSnapshot {
  std::string job_id;
  int attempt = 0;
  std::vector<RankSnapshot> ranks;
};

struct DetectionTimeouts {
  int64_t heartbeat_timeout_ms = 5000;
  int64_t hang_timeout_ms = 60000;
  int64_t start_timeout_ms = 600000;  // hang (b) for phase "starting", hang (c) awaiting it
  // A stream that closed at most this long after the last heartbeat (and at most
  // heartbeat_timeout) closed while its process was heartbeating: it exited. Below the
  // keepalive timeout (at least 20 s, rpc/liveness.h) after which a worker gives up on an
  // unreachable coordinator (so a partition's drop is never taken for an exit), and wide
  // enough for heartbeats late by seconds on a loaded machine (so a kill -9 is not taken
  // for silence).
  int64_t exit_window_ms = 4000;
  // A rank whose last heartbeat is older than this (and not older than
  // heartbeat_timeout_ms) is late (see the header comment): rpc::LivenessFor(interval,
  // heartbeat timeout).late_after; the default is the coordinator defaults'.
  int64_t late_after_ms = 2250;
};

// How its Assignments stream stands, as the rules read it.
enum class StreamState : int {
  kOpen,           // open, or never opened since registration
  kClosing,        // closed within exit_window of its last heartbeat, which is not late
                   // (at most late_after old, or heartbeat_timeout if less): an exit if no
                   // heartbeat follows; the rules read it as open until then
  kExited,         // closed within exit_window of its last heartbeat, which is late by
                   // now: the process is gone
  kDroppedSilent,  // closed after a longer silence (keepalive dropped a silent peer:
                   // stopped, stuck or unreachable), or heartbeats came after the close (it
                   // reconnects): no proof of exit
};
StreamState StreamStateOf(const RankSnapshot& w, int64_t now_ms, const DetectionTimeouts& timeouts);

// A rank in phase "reporting" (training over, result on the way) is hung only after this
// many hang timeouts (hang (b)).
inline constexpr int64_t kReportingTimeouts = 4;

// What one rule says about an attempt: decided = false: nothing, ask the next rule;
// decided with a failure: the finding; decided without one: hold (no rule names anything
// this time).
struct Ruling {
  bool decided = false;
  std::optional<rackrun::v1::Failure> failure;
};

// The rules (see the header comment). `now_ms` is the clock time of the detection.
Ruling LostStreamRule(const AttemptSnapshot& attempt, int64_t now_ms,
                      const DetectionTimeouts& timeouts);
Ruling CollectiveHangRule(const AttemptSnapshot& attempt, int64_t now_ms,
                          const DetectionTimeouts& timeouts);
Ruling LostSilenceRule(const AttemptSnapshot& attempt, int64_t now_ms,
                       const DetectionTimeouts& timeouts);
Ruling RendezvousHangRule(const AttemptSnapshot& attempt, int64_t now_ms,
                          const DetectionTimeouts& timeouts);
Ruling PhaseHangRule(const AttemptSnapshot& attempt, int64_t now_ms,
                     const DetectionTimeouts& timeouts);

// The rules in order: at most one finding for the attempt.
std::optional<Finding> DetectFailure(const AttemptSnapshot& attempt, int64_t now_ms,
                                     const DetectionTimeouts& timeouts);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_FAILURE_DETECTOR_H_
