// The detection rules one by one, on hand-made snapshots (no Workers, no clock): what each
// rule names, when it holds back, and the order DetectFailure asks them in. The same rules
// through Workers (heartbeats on a fake clock) are in workers_test.cc.
#include "coordinator/failure_detector.h"

#include <gtest/gtest.h>

#include <string>

namespace rackrun::coordinator {
namespace {

using rpc::Phase;

constexpr int64_t kNow = 1'000'000;
// heartbeat 0.5 s, hang 2 s, start 2.5 s (as workers_test.cc).
const DetectionTimeouts kTimeouts{500, 2000, 2500};

// A rank that heartbeated just now, in `phase` for `age_ms`, registered long ago.
RankSnapshot Rank(int rank, const std::string& phase, int64_t age_ms = 0) {
  RankSnapshot r;
  r.rank = rank;
  r.worker_id = "w-" + std::to_string(rank + 1);
  r.host = "host" + std::to_string(rank);
  r.pid = 1000 + rank;
  r.phase_name = phase;
  r.phase = rpc::ParsePhase(phase);
  r.step = 7;
  r.registered_ms = kNow - 3'600'000;
  r.last_heartbeat_ms = kNow;
  r.phase_age_ms = age_ms;
  r.entered = 10;
  r.stream_seen = true;
  r.stream_open = true;
  return r;
}

// `r` blocked in collective n for `ms`.
RankSnapshot Blocked(RankSnapshot r, int64_t n, int64_t ms) {
  r.phase_name = "collective";
  r.phase = Phase::kCollective;
  r.entered = n;
  r.blocked_n = n;
  r.blocked_since_ms = kNow - ms;
  return r;
}

RankSnapshot SilentFor(RankSnapshot r, int64_t ms) {
  r.last_heartbeat_ms = kNow - ms;
  return r;
}

// `r`'s stream closed `ms` after its last heartbeat.
RankSnapshot ClosedAfter(RankSnapshot r, int64_t ms) {
  r.stream_open = false;
  r.stream_closed_ms = r.last_heartbeat_ms + ms;
  return r;
}

AttemptSnapshot Attempt(std::vector<RankSnapshot> ranks) {
  return AttemptSnapshot{"j-1", 1, std::move(ranks)};
}

// An attempt whose data channel is still being built: no rank has entered a collective.
AttemptSnapshot InRendezvous(std::vector<RankSnapshot> ranks) {
  for (RankSnapshot& r : ranks) r.entered = 0;
  return Attempt(std::move(ranks));
}

void ExpectNames(const Ruling& r, rackrun::v1::FailureKind kind, int rank,
                 const std::string& text = "") {
  ASSERT_TRUE(r.decided);
  ASSERT_TRUE(r.failure.has_value());
  EXPECT_EQ(r.failure->kind(), kind);
  EXPECT_EQ(r.failure->rank(), rank);
  EXPECT_EQ(r.failure->time_unix_ms(), kNow);
  EXPECT_NE(r.failure->message().find(text), std::string::npos) << r.failure->message();
}

TEST(LostStreamRuleTest, NamesTheRankWhoseStreamClosedTheFirstByWorkerId) {
  AttemptSnapshot a = Attempt({Rank(0, "data"), Rank(1, "data"), Rank(2, "data")});
  EXPECT_FALSE(LostStreamRule(a, kNow, kTimeouts).decided);
  a.ranks[0].stream_seen = false;  // never opened one: not a closed stream
  a.ranks[0].stream_open = false;
  EXPECT_FALSE(LostStreamRule(a, kNow, kTimeouts).decided);
  // Closed as its last heartbeat came, which is not late yet: no verdict (a live worker's
  // next heartbeat would follow).
  a.ranks[1] = ClosedAfter(SilentFor(a.ranks[1], 400), 0);
  EXPECT_FALSE(LostStreamRule(a, kNow, kTimeouts).decided);
  a.ranks[1] = ClosedAfter(SilentFor(Rank(1, "data"), 501), 0);  // and none came
  a.ranks[1].worker_id = "w-2";
  a.ranks[2] = ClosedAfter(SilentFor(a.ranks[2], 501), 500);  // heartbeats fresh at the close
  a.ranks[2].worker_id = "w-10";                              // before "w-2"
  Ruling r = LostStreamRule(a, kNow, kTimeouts);
  ExpectNames(r, rackrun::v1::WORKER_LOST, 2, "connection to the coordinator closed");
  EXPECT_EQ(r.failure->worker_id(), "w-10");
  EXPECT_EQ(r.failure->host(), "host2");
  EXPECT_EQ(r.failure->pid(), 1002);
  EXPECT_EQ(r.failure->phase(), "data");
  EXPECT_EQ(r.failure->step(), 7);
}

// gRPC keepalive drops the connection of a peer that stopped answering (SIGSTOP, an
// unreachable host) 10-15 s after its last data: a stream that closed only after the
// heartbeats had stopped for the heartbeat timeout is no proof of exit.
TEST(StreamStateTest, AStreamClosedAfterTheHeartbeatsStoppedWasDroppedNotExited) {
  const RankSnapshot open = Rank(0, "data");
  EXPECT_EQ(StreamStateOf(open, kNow, kTimeouts), StreamState::kOpen);
  RankSnapshot never = open;
  never.stream_seen = never.stream_open = false;
  EXPECT_EQ(StreamStateOf(never, kNow, kTimeouts), StreamState::kOpen);
  EXPECT_EQ(StreamStateOf(ClosedAfter(open, 500), kNow + 501, kTimeouts), StreamState::kExited);
  EXPECT_EQ(StreamStateOf(ClosedAfter(open, 501), kNow + 501, kTimeouts),
            StreamState::kDroppedSilent);
  AttemptSnapshot a =
      Attempt({Rank(0, "data"), ClosedAfter(SilentFor(Rank(1, "forward"), 20000), 15000)});
  EXPECT_FALSE(LostStreamRule(a, kNow, kTimeouts).decided);
}

// A network partition shorter than the heartbeat timeout (10 s here) during which the
// worker's own keepalive gave up (5 s without an answer then; at least 20 s now,
// rpc/liveness.h): the coordinator sees the close when the link is back, 6 s after the
// last heartbeat. Not an exit (that closes within the
// exit window, 2 s): no rank is named, and once its heartbeats resume it is not silent
// either (tests/netns: CoordinatorCutsBelowTheBoundFailNothingAndOneWellAboveIsNamed).
TEST(StreamStateTest, AStreamClosedAfterAPartitionShorterThanTheHeartbeatTimeoutIsNoExit) {
  const DetectionTimeouts t{10000, 20000, 30000, 2000};
  const RankSnapshot open = Rank(0, "data");
  EXPECT_EQ(StreamStateOf(ClosedAfter(open, 2000), kNow + 2251, t), StreamState::kExited);
  EXPECT_EQ(StreamStateOf(ClosedAfter(open, 6000), kNow + 6000, t), StreamState::kDroppedSilent);
  // The close arrives as the link returns; the heartbeats resume right after.
  RankSnapshot back = ClosedAfter(SilentFor(Rank(1, "forward"), 6000), 6000);
  AttemptSnapshot a = Attempt({Rank(0, "forward"), back});
  std::optional<Finding> f = DetectFailure(a, kNow, t);
  EXPECT_FALSE(f.has_value()) << f->failure.message();
  a.ranks[1].last_heartbeat_ms = kNow + 200;  // a heartbeat after the close: alive
  EXPECT_EQ(StreamStateOf(a.ranks[1], kNow + 300, t), StreamState::kDroppedSilent);
  EXPECT_FALSE(DetectFailure(a, kNow + 300, t).has_value());
}

// A live worker's stream can close at the coordinator while its heartbeats are fresh: data
// sent into a cut link (a cancel, the next run) stays unacknowledged for the keepalive
// timeout, and the kernel drops the connection just after the link is back and the
// heartbeats resumed over a new connection. The close is an exit only once the
// heartbeats are late (a kill -9: none follows); a heartbeat after it proves the worker
// lives (tests/netns: ACutHostIsNamedAndTheJobRestartsOnASpareHost, which failed once for
// this, WORKER_LOST for a live idle worker).
TEST(StreamStateTest, AStreamClosedUnderAHeartbeatingWorkerIsAnExitOnlyIfTheHeartbeatsStop) {
  const DetectionTimeouts t{3000, 3000, 30000, 4000, 950};  // the daemon tests' timings
  RankSnapshot w = ClosedAfter(Rank(1, "idle"), 150);       // closed 150 ms after a heartbeat
  AttemptSnapshot a = Attempt({Rank(0, "connecting"), w});
  for (int64_t now = kNow + 150; now <= kNow + 950; now += 100) {
    EXPECT_EQ(StreamStateOf(w, now, t), StreamState::kClosing) << now - kNow;
    EXPECT_FALSE(DetectFailure(a, now, t).has_value()) << now - kNow;
  }
  // Its next heartbeat comes: it lives (and is told to open a new stream).
  a.ranks[1].last_heartbeat_ms = kNow + 200;
  EXPECT_EQ(StreamStateOf(a.ranks[1], kNow + 5000, t), StreamState::kDroppedSilent);
  EXPECT_FALSE(LostStreamRule(a, kNow + 2000, t).decided);
  // None comes (the process is gone): lost once the heartbeats are late.
  EXPECT_EQ(StreamStateOf(w, kNow + 951, t), StreamState::kExited);
  a.ranks[1] = w;
  std::optional<Finding> f = DetectFailure(a, kNow + 951, t);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->rule, DetectionRule::kLostStream);
  EXPECT_EQ(f->failure.kind(), rackrun::v1::WORKER_LOST);
  EXPECT_EQ(f->failure.rank(), 1);
}

TEST(CollectiveHangRuleTest, ASilentRankWhoseStreamWasDroppedIsNamed) {
  AttemptSnapshot a = Attempt(
      {ClosedAfter(SilentFor(Rank(0, "forward"), 2600), 1500), Blocked(Rank(1, ""), 8, 2100)});
  a.ranks[0].entered = 8;
  ExpectNames(CollectiveHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 0,
              "heartbeats stopped 2.6 s ago and its connection was dropped 1.5 s later");
  // Closed while it still heartbeated: it exited, and the lost-stream rule names it.
  a.ranks[0] = ClosedAfter(SilentFor(Rank(0, "forward"), 2600), 100);
  std::optional<Finding> f = DetectFailure(a, kNow, kTimeouts);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->rule, DetectionRule::kLostStream);
  EXPECT_EQ(f->failure.kind(), rackrun::v1::WORKER_LOST);
}

TEST(LostSilenceRuleTest, ASilentRankWhoseStreamWasDroppedIsLostWhenNoPeerWaits) {
  AttemptSnapshot a =
      Attempt({Rank(0, "data"), ClosedAfter(SilentFor(Rank(1, "data"), 2000), 1000)});
  std::optional<Finding> f = DetectFailure(a, kNow, kTimeouts);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->rule, DetectionRule::kLostSilence);
  EXPECT_EQ(f->failure.rank(), 1);
  EXPECT_NE(f->failure.message().find("no heartbeat for 2 s"), std::string::npos)
      << f->failure.message();
}

TEST(CollectiveHangRuleTest, NamesTheRankFurthestBehindThenTheLowest) {
  AttemptSnapshot a = Attempt({Blocked(Rank(0, ""), 8, 2100), Rank(1, "data"), Rank(2, "reduce"),
                               Blocked(Rank(3, ""), 8, 1500)});
  a.ranks[1].entered = 7;
  a.ranks[2].entered = 6;
  ExpectNames(CollectiveHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 2,
              "rank(s) 0 wait in collective 8 for 2.1 s; it has entered only 6 collectives");
  a.ranks[2].entered = 7;
  ExpectNames(CollectiveHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 1);
}

TEST(CollectiveHangRuleTest, NothingBeforeTheHangTimeout) {
  AttemptSnapshot a = Attempt({Blocked(Rank(0, ""), 8, 2000), Rank(1, "data")});
  a.ranks[1].entered = 7;
  EXPECT_FALSE(CollectiveHangRule(a, kNow, kTimeouts).decided);
}

TEST(CollectiveHangRuleTest, ASilentRankWithItsStreamOpenIsNamedFirst) {
  AttemptSnapshot a = Attempt(
      {Rank(0, "data"), SilentFor(Rank(1, "optimizer"), 600), Blocked(Rank(2, ""), 8, 2100)});
  a.ranks[0].entered = 7;  // behind, but alive
  a.ranks[1].entered = 8;
  ExpectNames(CollectiveHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 1,
              "heartbeats stopped 0.6 s ago");
}

TEST(CollectiveHangRuleTest, EveryRankInItHoldsThenNamesNoRank) {
  AttemptSnapshot a = Attempt({Blocked(Rank(0, ""), 3, 2500), Blocked(Rank(1, ""), 3, 2400)});
  Ruling hold = CollectiveHangRule(a, kNow, kTimeouts);  // up to hang + heartbeat timeout
  EXPECT_TRUE(hold.decided);
  EXPECT_FALSE(hold.failure.has_value());
  a.ranks[0].blocked_since_ms = kNow - 2501;
  Ruling r = CollectiveHangRule(a, kNow, kTimeouts);
  ExpectNames(r, rackrun::v1::HANG, -1, "every rank is in it");
  EXPECT_EQ(r.failure->worker_id(), "");
  EXPECT_EQ(r.failure->host(), "");
  EXPECT_EQ(r.failure->pid(), 0);
  EXPECT_EQ(r.failure->phase(), "collective");
}

// The rank behind waits in a collective of its own: the data its peers sent it is in
// flight (a link cut for a moment retransmits with TCP's backoff). Held like every rank
// in the collective, until hang + heartbeat timeout (2 + 0.5 s), then named.
TEST(CollectiveHangRuleTest,
     TheRankBehindWaitingInACollectiveItselfIsNamedAfterTheHeartbeatTimeoutMore) {
  AttemptSnapshot a = Attempt({Blocked(Rank(0, ""), 8, 2500), Blocked(Rank(1, ""), 7, 2000)});
  Ruling hold = CollectiveHangRule(a, kNow, kTimeouts);
  EXPECT_TRUE(hold.decided);
  EXPECT_FALSE(hold.failure.has_value());
  a.ranks[0].blocked_since_ms = kNow - 2501;
  ExpectNames(
      CollectiveHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 1,
      "rank(s) 0 wait in collective 8 for 2.501 s; it has entered only 7 collectives and has "
      "waited in collective 7 for 2 s itself (the data its peers sent it has not arrived");
}

// A rank whose last heartbeat is older than late_after (0.25 s here) but not overdue:
// its report may be out of date, so no hang verdict rests on it (nor on any report while
// it is late); once it reports again it is judged by that, once it is silent, for that.
TEST(CollectiveHangRuleTest, ALateRanksReportHoldsTheVerdict) {
  const DetectionTimeouts t{500, 2000, 2500, 4000, 250};
  AttemptSnapshot a = Attempt({Blocked(Rank(0, ""), 8, 2100), SilentFor(Rank(1, "data"), 300)});
  a.ranks[1].entered = 7;
  Ruling hold = CollectiveHangRule(a, kNow, t);
  EXPECT_TRUE(hold.decided);
  EXPECT_FALSE(hold.failure.has_value());
  EXPECT_FALSE(DetectFailure(a, kNow, t).has_value());
  a.ranks[1].last_heartbeat_ms = kNow - 100;  // it reported again: still behind
  ExpectNames(CollectiveHangRule(a, kNow, t), rackrun::v1::HANG, 1,
              "it has entered only 7 collectives");
  a.ranks[1].last_heartbeat_ms = kNow - 501;  // silent
  ExpectNames(CollectiveHangRule(a, kNow, t), rackrun::v1::HANG, 1,
              "its heartbeats stopped 0.501 s ago");
}

TEST(RendezvousHangRuleTest, ALateRankHoldsTheVerdict) {
  const DetectionTimeouts t{500, 2000, 2500, 4000, 250};
  AttemptSnapshot a =
      InRendezvous({Rank(0, "connecting", 2100), SilentFor(Rank(1, "data", 300), 300)});
  Ruling hold = RendezvousHangRule(a, kNow, t);
  EXPECT_TRUE(hold.decided);
  EXPECT_FALSE(hold.failure.has_value());
  a.ranks[1].last_heartbeat_ms = kNow;
  ExpectNames(RendezvousHangRule(a, kNow, t), rackrun::v1::HANG, 1, "in phase data");
}

TEST(PhaseHangRuleTest, ALateRankIsNotJudgedByItsLastReport) {
  const DetectionTimeouts t{500, 2000, 2500, 4000, 250};
  AttemptSnapshot a = Attempt({SilentFor(Rank(0, "checkpoint", 1800), 300)});
  EXPECT_FALSE(PhaseHangRule(a, kNow, t).decided);
  a.ranks[0].last_heartbeat_ms = kNow - 201;  // not late: 1.8 + 0.201 s in its phase
  ExpectNames(PhaseHangRule(a, kNow, t), rackrun::v1::HANG, 0, "in phase checkpoint for 2.001 s");
}

TEST(LostSilenceRuleTest, NamesTheSilentRankUnlessAPeerWaitsInACollective) {
  AttemptSnapshot a = Attempt({Rank(0, "data"), SilentFor(Rank(1, "data"), 501)});
  ExpectNames(LostSilenceRule(a, kNow, kTimeouts), rackrun::v1::WORKER_LOST, 1,
              "no heartbeat for 0.501 s (heartbeat timeout 0.5 s)");
  a.ranks[1].last_heartbeat_ms = kNow - 500;  // not overdue yet
  EXPECT_FALSE(LostSilenceRule(a, kNow, kTimeouts).decided);
  a.ranks[1].last_heartbeat_ms = kNow - 501;
  a.ranks[0] = Blocked(a.ranks[0], 4, 100);  // a peer waits for it: hang (a)'s case
  EXPECT_FALSE(LostSilenceRule(a, kNow, kTimeouts).decided);
}

TEST(RendezvousHangRuleTest, NamesTheAwaitedRankLongestInItsPhase) {
  AttemptSnapshot a =
      InRendezvous({Rank(0, "connecting", 2100), Rank(1, "data", 300), Rank(2, "", 400)});
  Ruling r = RendezvousHangRule(a, kNow, kTimeouts);
  // The empty phase counts as idle: rank 2 is awaited, longest in its phase.
  ExpectNames(r, rackrun::v1::HANG, 2,
              "rank(s) 0 wait in the data channel's rendezvous for 2.1 s for it; it has been in "
              "phase idle for 0.4 s");
  a.ranks[0].phase_age_ms = 2000;
  EXPECT_FALSE(RendezvousHangRule(a, kNow, kTimeouts).decided);
}

TEST(RendezvousHangRuleTest, AStartingRankIsAwaitedUpToTheStartTimeout) {
  AttemptSnapshot a = InRendezvous({Rank(0, "connecting", 2500), Rank(1, "starting", 100)});
  EXPECT_FALSE(RendezvousHangRule(a, kNow, kTimeouts).decided);
  a.ranks[0].phase_age_ms = 2501;
  ExpectNames(RendezvousHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 1, "in phase starting");
}

// Every rank waits for the store and the network, not for a rank: named after the hang
// timeout plus the heartbeat timeout (2 + 0.5 s).
TEST(RendezvousHangRuleTest, EveryRankInItNamesNoRankAfterTheHangAndHeartbeatTimeouts) {
  AttemptSnapshot a = InRendezvous({Rank(0, "connecting", 2500), Rank(1, "connecting", 1900)});
  EXPECT_FALSE(RendezvousHangRule(a, kNow, kTimeouts).decided);
  a.ranks[0].phase_age_ms = 2501;
  Ruling r = RendezvousHangRule(a, kNow, kTimeouts);
  ExpectNames(r, rackrun::v1::HANG, -1, "rank(s) 0 wait in the data channel's rendezvous");
  EXPECT_EQ(r.failure->phase(), "connecting");
  EXPECT_EQ(r.failure->worker_id(), "");
}

// DaemonsTest.StoppedWorkerIsNamedAsHung failed so once: rank 1's last heartbeat came
// during its rendezvous, it trained a few steps and was stopped, and its stale
// "connecting" outgrew the hang timeout before rank 0's wait in the collective did.
TEST(RendezvousHangRuleTest, OnceARankHasEnteredACollectiveTheRendezvousIsOver) {
  AttemptSnapshot a =
      InRendezvous({Blocked(Rank(0, "collective"), 7, 1000), Rank(1, "connecting", 4000)});
  EXPECT_FALSE(RendezvousHangRule(a, kNow, kTimeouts).decided);
  EXPECT_FALSE(DetectFailure(a, kNow, kTimeouts).has_value());
  // The collective rule names the rank the others wait for once they have waited too long.
  a.ranks[0] = Blocked(Rank(0, "collective"), 7, 2001);
  std::optional<Finding> f = DetectFailure(a, kNow, kTimeouts);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->rule, DetectionRule::kCollectiveHang);
  EXPECT_EQ(f->failure.rank(), 1);
  // A peer that has entered collectives, blocked or not, ends the rendezvous too.
  a = InRendezvous({Rank(0, "data", 100), Rank(1, "connecting", 4000)});
  a.ranks[0].entered = 3;
  EXPECT_FALSE(RendezvousHangRule(a, kNow, kTimeouts).decided);
  a.ranks[0].entered = 0;
  ExpectNames(RendezvousHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 0, "in phase data");
}

TEST(PhaseHangRuleTest, ATrainingPhaseHasTheHangTimeoutAndStartingItsOwn) {
  AttemptSnapshot a = Attempt({Rank(0, "checkpoint", 2000), Rank(1, "starting", 2500)});
  EXPECT_FALSE(PhaseHangRule(a, kNow, kTimeouts).decided);
  a.ranks[1].phase_age_ms = 2501;
  ExpectNames(PhaseHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 1,
              "in phase starting for 2.501 s (start timeout 2.5 s)");
  a.ranks[0].last_heartbeat_ms = kNow - 1;  // the age grows with the time since the heartbeat
  ExpectNames(PhaseHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 0,
              "in phase checkpoint for 2.001 s (hang timeout 2 s)");
}

TEST(PhaseHangRuleTest, APhaseNameItDoesNotKnowIsJudgedAsATrainingPhase) {
  AttemptSnapshot a = Attempt({Rank(0, "forward", 2001)});
  EXPECT_EQ(a.ranks[0].phase, Phase::kOther);
  ExpectNames(PhaseHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 0, "in phase forward for");
}

TEST(PhaseHangRuleTest, VictimsIdleAndSilentRanksAreNeverNamed) {
  AttemptSnapshot a =
      Attempt({Rank(0, "idle", 99000), Rank(1, "", 99000), Rank(2, "collective", 99000),
               Rank(3, "connecting", 99000), SilentFor(Rank(4, "data", 99000), 501),
               Blocked(Rank(5, "data", 99000), 3, 10)});
  a.ranks[5].phase_name = "data";
  a.ranks[5].phase = Phase::kData;
  EXPECT_FALSE(PhaseHangRule(a, kNow, kTimeouts).decided);
}

TEST(PhaseHangRuleTest, ReportingAfterFourHangTimeoutsCountedFromTheRegistration) {
  AttemptSnapshot a = Attempt({Rank(0, "reporting", 8000)});
  EXPECT_FALSE(PhaseHangRule(a, kNow, kTimeouts).decided);
  a.ranks[0].phase_age_ms = 8001;
  ExpectNames(PhaseHangRule(a, kNow, kTimeouts), rackrun::v1::HANG, 0,
              "in phase reporting (training over, result not delivered) for 8.001 s (4 x the hang "
              "timeout of 2 s)");
  a.ranks[0].registered_ms = kNow - 8000;  // re-registered since: its age counts from there
  EXPECT_FALSE(PhaseHangRule(a, kNow, kTimeouts).decided);
}

TEST(DetectFailureTest, AsksTheRulesInOrderAndSaysWhichFound) {
  // A closed stream comes before a silent rank.
  AttemptSnapshot a =
      Attempt({SilentFor(Rank(0, "data"), 600), ClosedAfter(SilentFor(Rank(1, "data"), 501), 0)});
  std::optional<Finding> f = DetectFailure(a, kNow, kTimeouts);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->job_id, "j-1");
  EXPECT_EQ(f->attempt, 1);
  EXPECT_EQ(f->rule, DetectionRule::kLostStream);
  EXPECT_EQ(f->failure.rank(), 1);
  a.ranks[1].stream_open = true;
  a.ranks[1].last_heartbeat_ms = kNow;
  f = DetectFailure(a, kNow, kTimeouts);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->rule, DetectionRule::kLostSilence);
  EXPECT_EQ(f->failure.rank(), 0);
}

TEST(DetectFailureTest, TheCollectiveRuleHoldingStopsTheLaterRules) {
  // Every rank has entered collective 3; rank 1 completed it and sits in a phase past the
  // hang timeout. While hang (a) holds, hang (b) is not asked.
  AttemptSnapshot a = Attempt({Blocked(Rank(0, ""), 3, 2100), Rank(1, "optimizer", 2100)});
  a.ranks[1].entered = 3;
  EXPECT_FALSE(DetectFailure(a, kNow, kTimeouts).has_value());
  a.ranks[0].blocked_since_ms = kNow - 1000;  // not waiting long enough: hang (b) names rank 1
  std::optional<Finding> f = DetectFailure(a, kNow, kTimeouts);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->rule, DetectionRule::kPhaseHang);
  EXPECT_EQ(f->failure.rank(), 1);
}

TEST(DetectFailureTest, NothingWrongNothingFound) {
  EXPECT_FALSE(DetectFailure(Attempt({}), kNow, kTimeouts).has_value());
  EXPECT_FALSE(
      DetectFailure(Attempt({Rank(0, "data", 100), Rank(1, "connecting", 100)}), kNow, kTimeouts)
          .has_value());
}

}  // namespace
}  // namespace rackrun::coordinator
