#include "coordinator/workers.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>

#include "coordinator/test_util.h"
#include "rpc/liveness.h"

namespace rackrun::coordinator {
namespace {

using rackrun::v1::HeartbeatRequest;

class WorkersTest : public ::testing::Test {
 protected:
  WorkersTest()
      : workers_(clock_.clock(), Workers::Options{100, 500, 2000, 2500},
                 [this]() -> absl::StatusOr<int64_t> { return ++next_; }) {}

  // Registers `n` workers with open streams running ranks 0..n-1 of (job, attempt 1).
  std::vector<std::string> Start(int n, const std::string& job = "j-1") {
    std::vector<std::string> ids;
    for (int r = 0; r < n; ++r) {
      rackrun::v1::RegisterRequest req;
      req.set_host("host" + std::to_string(r));
      req.set_pid(1000 + r);
      req.add_channels("ucx");
      req.add_channels("gloo");
      auto id = workers_.Register(req);
      EXPECT_TRUE(id.ok());
      auto gen = workers_.OpenStream(*id);
      EXPECT_TRUE(gen.ok());
      gens_.push_back(*gen);
      workers_.SetBusy(*id, job, 1, r);
      ids.push_back(*id);
    }
    return ids;
  }

  void Beat(const std::string& id, int64_t step, const std::string& phase, int64_t entered,
            int64_t completed, int64_t phase_age_ms = 0) {
    HeartbeatRequest hb;
    hb.set_worker_id(id);
    hb.set_job_id("j-1");
    hb.set_attempt(1);
    hb.set_step(step);
    hb.set_phase(phase);
    hb.set_collectives_entered(entered);
    hb.set_collectives_completed(completed);
    hb.set_phase_age_ms(phase_age_ms);
    ASSERT_TRUE(workers_.Heartbeat(hb).ok());
  }

  // Detect finds exactly one thing now: a HANG naming `rank`, its message containing `text`.
  void ExpectOneHang(int rank, const std::string& text = "") {
    std::vector<Finding> f = workers_.Detect();
    ASSERT_EQ(f.size(), 1u);
    EXPECT_EQ(f[0].failure.kind(), rackrun::v1::HANG);
    EXPECT_EQ(f[0].failure.rank(), rank);
    EXPECT_NE(f[0].failure.message().find(text), std::string::npos) << f[0].failure.message();
  }

  // Rank 0 of `ids` is SIGSTOPped after step 4: no heartbeats; rank 1 waits in collective
  // 6. When `drop_at` >= 0, gRPC keepalive drops rank 0's connection at that tick (10-15 s
  // after its last data in the daemons; here 1 s into its silence, past the 0.5 s heartbeat
  // timeout). Either way a peer waits for it: nothing before the hang timeout (rank 0 stays
  // BUSY), then a HANG naming rank 0 in phase forward, never WORKER_LOST. nullopt: never named.
  std::optional<Finding> StopRankZeroUntilNamed(const std::vector<std::string>& ids, int drop_at) {
    for (int t = 0; t < 25; ++t) {
      clock_.Advance(100);
      Beat(ids[1], 4, "collective", 6, 5);
      if (t == drop_at) workers_.CloseStream(ids[0], gens_[0]);
      std::vector<Finding> f = workers_.Detect();
      if (t < 19) {
        EXPECT_TRUE(f.empty()) << t;
        EXPECT_EQ(workers_.List(false).workers(0).state(), rackrun::v1::BUSY) << t;
      } else if (!f.empty()) {
        EXPECT_EQ(f.size(), 1u);
        EXPECT_EQ(f[0].failure.kind(), rackrun::v1::HANG);
        EXPECT_EQ(f[0].failure.rank(), 0);
        EXPECT_EQ(f[0].failure.phase(), "forward");
        return f[0];
      }
    }
    return std::nullopt;
  }

  // One 100 ms tick of a rank waiting in collective n since tick 0, at tick t.
  void WaitingIn(const std::string& id, int64_t step, int64_t n, int t) {
    Beat(id, step, "collective", n, n - 1, 100 * t);
  }
  // Every rank of `ids` waits in collective n at `step` for ticks [t0, t1), 100 ms each;
  // nothing is detected before tick `quiet_until` (Detect is only asked until then).
  void AllWaitIn(const std::vector<std::string>& ids, int64_t step, int64_t n, int t0, int t1,
                 int quiet_until) {
    for (int t = t0; t < t1; ++t) {
      clock_.Advance(100);
      for (const std::string& id : ids) WaitingIn(id, step, n, t);
      if (t < quiet_until) {
        EXPECT_TRUE(workers_.Detect().empty()) << t;
      }
    }
  }

  testing::FakeClock clock_;
  int64_t next_ = 0;
  std::vector<int64_t> gens_;
  Workers workers_;
};

TEST_F(WorkersTest, RegisterAssignsIdsAndKeepsGivenOnes) {
  rackrun::v1::RegisterRequest req;
  req.set_host("h");
  EXPECT_EQ(*workers_.Register(req), "w-1");
  EXPECT_EQ(*workers_.Register(req), "w-2");
  req.set_worker_id("w-7");
  EXPECT_EQ(*workers_.Register(req), "w-7");
  req.set_host("");
  EXPECT_EQ(workers_.Register(req).status().code(), absl::StatusCode::kInvalidArgument);
  HeartbeatRequest hb;
  hb.set_worker_id("w-9");
  EXPECT_EQ(workers_.Heartbeat(hb).code(), absl::StatusCode::kNotFound);
}

TEST_F(WorkersTest, LostByMissingHeartbeatNamesTheSilentRank) {
  auto ids = Start(2);
  for (int t = 0; t < 4; ++t) {
    clock_.Advance(100);
    Beat(ids[0], 5, "forward", 10, 10);
    Beat(ids[1], 5, "forward", 10, 10);
  }
  EXPECT_TRUE(workers_.Detect().empty());
  for (int t = 0; t < 6; ++t) {  // rank 1 goes silent; rank 0 keeps computing
    clock_.Advance(100);
    Beat(ids[0], 6, "forward", 10, 10);
  }
  std::vector<Finding> f = workers_.Detect();
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].job_id, "j-1");
  EXPECT_EQ(f[0].failure.kind(), rackrun::v1::WORKER_LOST);
  EXPECT_EQ(f[0].failure.rank(), 1);
  EXPECT_EQ(f[0].failure.host(), "host1");
  EXPECT_EQ(f[0].failure.pid(), 1001);
  EXPECT_EQ(f[0].failure.step(), 5);
  EXPECT_EQ(f[0].failure.phase(), "forward");
  EXPECT_TRUE(workers_.Detect().empty());  // reported once
  HeartbeatRequest hb;
  hb.set_worker_id(ids[1]);
  EXPECT_EQ(workers_.Heartbeat(hb).code(), absl::StatusCode::kNotFound);  // must re-register
}

// A stream that closes while the worker heartbeats is an exit once its heartbeats are late
// (rpc/liveness.h late_after: 100 ms + the retry period here), not before: a live worker's
// heartbeat would have come by then.
TEST_F(WorkersTest, LostWhenTheStreamClosesAndNoHeartbeatFollows) {
  auto ids = Start(3);
  workers_.CloseStream(ids[2], gens_[2]);
  EXPECT_TRUE(workers_.Detect().empty());
  const int64_t late_after =
      rpc::LivenessFor(std::chrono::milliseconds(100), std::chrono::milliseconds(500))
          .late_after.count();
  std::vector<Finding> f;
  int64_t waited = 0;
  while (f.empty() && waited <= 500) {
    clock_.Advance(10);
    waited += 10;
    Beat(ids[0], 5, "forward", 10, 10);
    Beat(ids[1], 5, "forward", 10, 10);
    f = workers_.Detect();
  }
  EXPECT_GT(waited, std::min<int64_t>(late_after, 500));
  EXPECT_LE(waited, std::min<int64_t>(late_after, 500) + 10);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].failure.kind(), rackrun::v1::WORKER_LOST);
  EXPECT_EQ(f[0].failure.rank(), 2);
  EXPECT_EQ(f[0].failure.worker_id(), ids[2]);
  EXPECT_NE(f[0].failure.message().find("connection to the coordinator closed"), std::string::npos)
      << f[0].failure.message();
}

// The stream of a live worker closes here only (its connection died under it): it goes on
// heartbeating, is not lost, and each heartbeat's answer says stream_closed, so that it
// opens a new one. Its run is still at hand for the rack to send again (BusyRun) while it
// is busy with that attempt.
TEST_F(WorkersTest, AStreamClosedUnderAHeartbeatingWorkerIsReportedNotLost) {
  auto ids = Start(2);
  rackrun::v1::Assignment a;
  a.mutable_run()->set_job_id("j-1");
  a.mutable_run()->set_attempt(1);
  a.mutable_run()->set_rank(1);
  workers_.Push(ids[1], a);
  rackrun::v1::HeartbeatResponse resp;
  HeartbeatRequest hb;
  hb.set_worker_id(ids[1]);
  hb.set_phase("idle");
  ASSERT_TRUE(workers_.Heartbeat(hb, &resp).ok());
  EXPECT_FALSE(resp.stream_closed());
  workers_.CloseStream(ids[1], gens_[1]);
  for (int t = 0; t < 15; ++t) {  // 1.5 s, below the hang timeout of its waiting peer
    clock_.Advance(100);
    Beat(ids[0], 0, "connecting", 0, 0, 100 * t);
    ASSERT_TRUE(workers_.Heartbeat(hb, &resp).ok());
    EXPECT_TRUE(resp.stream_closed()) << t;
    EXPECT_TRUE(workers_.Detect().empty()) << t;
    EXPECT_EQ(workers_.List(false).workers(1).state(), rackrun::v1::BUSY) << t;
  }
  const std::optional<rackrun::v1::RunJob> run = workers_.BusyRun(ids[1]);
  ASSERT_TRUE(run.has_value());
  EXPECT_EQ(run->job_id(), "j-1");
  EXPECT_EQ(run->rank(), 1);
  EXPECT_FALSE(workers_.BusyRun(ids[0]).has_value());  // no run pushed to it
  workers_.SetIdle(ids[1], "j-1");
  EXPECT_FALSE(workers_.BusyRun(ids[1]).has_value());  // not busy
  // A new stream (after registering again) is open: no longer reported closed.
  rackrun::v1::RegisterRequest req;
  req.set_host("host1");
  req.set_worker_id(ids[1]);
  ASSERT_TRUE(workers_.Register(req).ok());
  ASSERT_TRUE(workers_.Heartbeat(hb, &resp).ok());
  EXPECT_FALSE(resp.stream_closed());
  ASSERT_TRUE(workers_.OpenStream(ids[1]).ok());
  ASSERT_TRUE(workers_.Heartbeat(hb, &resp).ok());
  EXPECT_FALSE(resp.stream_closed());
}

// Assignments are numbered from 1 per registration; one written into an open stream that
// the heartbeats do not acknowledge (assignments_received) within StallAfterMs is said to
// have stalled the stream, once per wait; queued ones (not written) and acknowledged ones
// never are, and a closed stream is said closed, not stalled.
TEST_F(WorkersTest, AnAssignmentTheHeartbeatsDoNotAcknowledgeStallsTheStream) {
  auto ids = Start(1);
  // Interval 100 ms, timeout 500 ms: late after 100 + max(100, 125) ms, plus an interval.
  ASSERT_EQ(workers_.StallAfterMs(), 325);
  rackrun::v1::Assignment run, cancel;
  run.mutable_run()->set_job_id("j-1");
  run.mutable_run()->set_attempt(1);
  cancel.mutable_cancel()->set_job_id("j-1");
  cancel.mutable_cancel()->set_attempt(1);
  workers_.Push(ids[0], run);
  workers_.Push(ids[0], cancel);
  HeartbeatRequest hb;
  hb.set_worker_id(ids[0]);
  rackrun::v1::HeartbeatResponse resp;
  const auto beat = [&](int64_t advance_ms, int64_t received) {
    clock_.Advance(advance_ms);
    hb.set_assignments_received(received);
    EXPECT_TRUE(workers_.Heartbeat(hb, &resp).ok());
    EXPECT_FALSE(resp.stream_closed());
    return resp.stream_stalled();
  };
  EXPECT_FALSE(beat(1000, 0));  // queued, not written yet: nothing to acknowledge
  const auto next = [&] {
    auto a = workers_.NextAssignment(ids[0], gens_[0], absl::ZeroDuration());
    EXPECT_TRUE(a.ok() && a->has_value());
    return a.ok() && a->has_value() ? (*a)->sequence() : -1;
  };
  EXPECT_EQ(next(), 1);
  EXPECT_FALSE(beat(300, 0));
  EXPECT_TRUE(beat(50, 0));    // 350 ms unacknowledged
  EXPECT_FALSE(beat(50, 0));   // said once per wait
  EXPECT_FALSE(beat(250, 0));  // 300 ms since it was said ...
  EXPECT_TRUE(beat(50, 0));    // ... 350: said again
  EXPECT_EQ(next(), 2);
  EXPECT_FALSE(beat(300, 1));  // progress: the rest is timed from here
  EXPECT_FALSE(beat(300, 1));
  EXPECT_TRUE(beat(50, 1));
  EXPECT_FALSE(beat(50, 2));  // all acknowledged
  EXPECT_FALSE(beat(1000, 2));
  // A new registration numbers from 1 again; a stale larger count acknowledges no more than
  // what was written.
  rackrun::v1::RegisterRequest req;
  req.set_host("host0");
  req.set_worker_id(ids[0]);
  ASSERT_TRUE(workers_.Register(req).ok());
  absl::StatusOr<int64_t> gen = workers_.OpenStream(ids[0]);
  ASSERT_TRUE(gen.ok());
  gens_[0] = *gen;
  workers_.Push(ids[0], run);
  EXPECT_EQ(next(), 1);
  EXPECT_FALSE(beat(300, 0));
  EXPECT_TRUE(beat(50, 0));
  workers_.Push(ids[0], cancel);
  EXPECT_EQ(next(), 2);
  EXPECT_FALSE(beat(400, 1));  // progress
  // A closed stream is said closed (stream_closed), not stalled.
  workers_.CloseStream(ids[0], gens_[0]);
  clock_.Advance(1000);
  hb.set_assignments_received(1);
  ASSERT_TRUE(workers_.Heartbeat(hb, &resp).ok());
  EXPECT_TRUE(resp.stream_closed());
  EXPECT_FALSE(resp.stream_stalled());
}

// A coordinator back with a new job store numbers workers from w-1 again while the workers
// of its old store register again keeping their ids: a new worker gets the next id no
// worker here holds, never a held one (that registration would replace the other worker's).
TEST_F(WorkersTest, ANewWorkerNeverGetsAnIdThatAWorkerHereKept) {
  rackrun::v1::RegisterRequest req;
  req.set_host("old");
  for (const char* kept : {"w-1", "w-2", "w-4"}) {
    req.set_worker_id(kept);
    ASSERT_EQ(workers_.Register(req).value_or(""), kept);
  }
  rackrun::v1::RegisterRequest fresh;
  fresh.set_host("new");
  EXPECT_EQ(workers_.Register(fresh).value_or(""), "w-3");
  EXPECT_EQ(workers_.Register(fresh).value_or(""), "w-5");
  EXPECT_EQ(workers_.List(/*include_gone=*/true).workers_size(), 5);
}

// At most max_live workers are live: one more registration is refused naming the flag, a
// live worker registering again is not one more, and an ended one makes room.
TEST_F(WorkersTest, RegistrationsBeyondTheLiveLimitAreRefused) {
  int64_t next = 0;
  Workers::Options o{100, 500, 2000, 2500};
  o.max_live = 2;
  Workers w(clock_.clock(), o, [&next]() -> absl::StatusOr<int64_t> { return ++next; });
  rackrun::v1::RegisterRequest req;
  req.set_host("host");
  const absl::StatusOr<std::string> a = w.Register(req);
  const absl::StatusOr<std::string> b = w.Register(req);
  ASSERT_TRUE(a.ok() && b.ok());
  const absl::StatusOr<std::string> c = w.Register(req);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("2 workers are live"), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("--max-workers 2"), std::string::npos) << c.status();
  EXPECT_EQ(w.List(/*include_gone=*/true).workers_size(), 2);
  rackrun::v1::RegisterRequest again = req;
  again.set_worker_id(*a);
  EXPECT_EQ(w.Register(again).value_or(""), *a);
  ASSERT_TRUE(w.Deregister(*b).ok());
  const absl::StatusOr<std::string> d = w.Register(req);
  ASSERT_TRUE(d.ok()) << d.status();
  again.set_worker_id(*b);  // ended: registering again is one more live worker
  EXPECT_EQ(w.Register(again).status().code(), absl::StatusCode::kResourceExhausted);
}

// Ended workers (GONE, LOST) are forgotten once more than max_ended are kept (the longest
// ended first) or once they ended forget_after_ms ago; live ones never; a forgotten worker
// that comes back registers with its id again.
TEST_F(WorkersTest, EndedWorkersAreForgottenPastTheirLimits) {
  int64_t next = 0;
  Workers w(clock_.clock(), Workers::Options{100, 500, 2000, 2500, 1000, 2},
            [&next]() -> absl::StatusOr<int64_t> { return ++next; });
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    rackrun::v1::RegisterRequest req;
    req.set_host("host" + std::to_string(i));
    absl::StatusOr<std::string> id = w.Register(req);
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  const auto listed = [&] {
    std::vector<std::string> out;
    const rackrun::v1::ListWorkersResponse all = w.List(/*include_gone=*/true);
    for (const rackrun::v1::Worker& x : all.workers()) out.push_back(x.id());
    return out;
  };
  const auto tick = [&](int64_t ms) {
    clock_.Advance(ms);
    HeartbeatRequest hb;
    hb.set_worker_id(ids[3]);  // the live one
    ASSERT_TRUE(w.Heartbeat(hb).ok());
    w.Detect();
  };
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(w.Deregister(ids[i]).ok());
    tick(100);
  }
  // Three ended, two kept: the first to end is forgotten.
  EXPECT_EQ(listed(), (std::vector<std::string>{ids[1], ids[2], ids[3]}));
  tick(850);  // ids[1] ended 1050 ms ago, ids[2] 950
  EXPECT_EQ(listed(), (std::vector<std::string>{ids[2], ids[3]}));
  tick(100);
  EXPECT_EQ(listed(), (std::vector<std::string>{ids[3]}));
  // A forgotten worker's heartbeat is refused (it registers again), and it may keep its id.
  HeartbeatRequest hb;
  hb.set_worker_id(ids[0]);
  EXPECT_EQ(w.Heartbeat(hb).code(), absl::StatusCode::kNotFound);
  rackrun::v1::RegisterRequest again;
  again.set_host("host0");
  again.set_worker_id(ids[0]);
  ASSERT_EQ(w.Register(again).value_or(""), ids[0]);
  EXPECT_TRUE(w.Heartbeat(hb).ok());
  EXPECT_EQ(listed(), (std::vector<std::string>{ids[0], ids[3]}));
}

// Detect's marks of the attempts it named (or looked at) go once no worker is busy with
// them: a coordinator that runs jobs for months does not keep one per attempt ever run.
TEST_F(WorkersTest, EndedAttemptsAreNotTrackedAnyLonger) {
  auto ids = Start(2);
  for (int attempt = 1; attempt <= 50; ++attempt) {
    const std::string job = "j-" + std::to_string(attempt);
    workers_.SetBusy(ids[0], job, 1, 0);
    workers_.SetBusy(ids[1], job, 1, 1);
    clock_.Advance(100);
    Beat(ids[0], 1, "forward", 1, 1);
    Beat(ids[1], 1, "forward", 1, 1);
    EXPECT_TRUE(workers_.Detect().empty());
    EXPECT_EQ(workers_.AttemptsTracked(), 1);
    workers_.SetIdle(ids[0], job);
    workers_.SetIdle(ids[1], job);
  }
  clock_.Advance(100);
  EXPECT_TRUE(workers_.Detect().empty());
  EXPECT_EQ(workers_.AttemptsTracked(), 0);
}

TEST_F(WorkersTest, HungByTheCollectiveRuleNamesTheRankBehind) {
  auto ids = Start(3);
  // Ranks 0 and 2 wait in collective 8; rank 1 is alive but still computing (entered 7).
  for (int t = 0; t < 25; ++t) {
    clock_.Advance(100);
    Beat(ids[0], 3, "collective", 8, 7);
    Beat(ids[1], 3, "backward", 7, 7, 100 * t);
    Beat(ids[2], 3, "collective", 8, 7);
    if (t < 19) {
      EXPECT_TRUE(workers_.Detect().empty()) << t;
    }
  }
  std::vector<Finding> f = workers_.Detect();
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].failure.kind(), rackrun::v1::HANG);
  EXPECT_EQ(f[0].failure.rank(), 1);  // the culprit, not the victims waiting for it
  EXPECT_EQ(f[0].failure.phase(), "backward");
  EXPECT_EQ(f[0].failure.step(), 3);
  EXPECT_NE(f[0].failure.message().find("collective 8"), std::string::npos)
      << f[0].failure.message();
}

// Rank 0 is SIGSTOPped after step 4: no heartbeats; rank 1 waits in collective 6. When
// `drop_at` >= 0, gRPC keepalive drops rank 0's connection at that tick (10-15 s after its
// last data in the daemons; here 1 s into its silence, past the 0.5 s heartbeat timeout).
// Either way a peer waits for it, so it is a HANG naming it after the hang timeout, never
// WORKER_LOST; returns the finding.
TEST_F(WorkersTest, HungWhenStoppedWithTheConnectionOpen) {
  auto ids = Start(2);
  clock_.Advance(100);
  Beat(ids[0], 4, "forward", 5, 5);
  Beat(ids[1], 4, "forward", 5, 5);
  const std::optional<Finding> f = StopRankZeroUntilNamed(ids, -1);
  ASSERT_TRUE(f.has_value()) << "the stopped rank was never named";
  EXPECT_NE(f->failure.message().find("connection stays open"), std::string::npos)
      << f->failure.message();
}

// The same, but keepalive drops the stopped rank's connection before the peers have waited
// the hang timeout: still a HANG naming it; the rank is LOST only after that.
TEST_F(WorkersTest, HungWhenStoppedAndKeepaliveDropsTheConnection) {
  auto ids = Start(2);
  clock_.Advance(100);
  Beat(ids[0], 4, "forward", 5, 5);
  Beat(ids[1], 4, "forward", 5, 5);
  const std::optional<Finding> f = StopRankZeroUntilNamed(ids, 10);
  ASSERT_TRUE(f.has_value()) << "the stopped rank was never named";
  EXPECT_NE(f->failure.message().find("connection was dropped"), std::string::npos)
      << f->failure.message();
  EXPECT_TRUE(workers_.Detect().empty());  // reported once
  EXPECT_EQ(workers_.List(false).workers(0).state(), rackrun::v1::LOST);
}

TEST_F(WorkersTest, HungByThePhaseRule) {
  auto ids = Start(2);
  for (int t = 1; t <= 25; ++t) {
    clock_.Advance(100);
    Beat(ids[0], 9, "checkpoint", 20, 20, 100 * t);  // stuck writing a checkpoint
    Beat(ids[1], 9, "forward", 20, 20, 50);
    if (t < 20) {
      EXPECT_TRUE(workers_.Detect().empty()) << t;
    }
  }
  std::vector<Finding> f = workers_.Detect();
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].failure.kind(), rackrun::v1::HANG);
  EXPECT_EQ(f[0].failure.rank(), 0);
  EXPECT_EQ(f[0].failure.phase(), "checkpoint");
}

// Phase "starting" has a timeout of its own (here 4 s against the 2 s hang timeout): a
// rank building a big model on a loaded machine is not hung at the hang timeout.
TEST_F(WorkersTest, StartingIsJudgedByTheStartTimeout) {
  Workers workers(clock_.clock(), Workers::Options{100, 500, 2000, 4000},
                  [this]() -> absl::StatusOr<int64_t> { return ++next_; });
  rackrun::v1::RegisterRequest req;
  req.set_host("h");
  req.set_pid(7);
  const std::string id = *workers.Register(req);
  ASSERT_TRUE(workers.OpenStream(id).ok());
  workers.SetBusy(id, "j-1", 1, 0);
  HeartbeatRequest hb;
  hb.set_worker_id(id);
  hb.set_phase("starting");
  for (int t = 1; t <= 40; ++t) {
    clock_.Advance(100);
    hb.set_phase_age_ms(100 * t);
    ASSERT_TRUE(workers.Heartbeat(hb).ok());
    EXPECT_TRUE(workers.Detect().empty()) << t;
  }
  clock_.Advance(100);
  hb.set_phase_age_ms(4100);
  ASSERT_TRUE(workers.Heartbeat(hb).ok());
  std::vector<Finding> f = workers.Detect();
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].failure.kind(), rackrun::v1::HANG);
  EXPECT_EQ(f[0].failure.phase(), "starting");
  EXPECT_NE(f[0].failure.message().find("start timeout 4 s"), std::string::npos)
      << f[0].failure.message();
}

// A rank whose training is over delivers its result; until the coordinator has it (e.g.
// after the coordinator restarted and the worker re-attached) its heartbeats say
// "reporting" with the age since training ended, here 5 s at the re-registration. That is
// no hang at hang_timeout (2 s): its age counts from the registration, and only past 4 x
// hang_timeout is the rank named (a teardown or report stuck for good). The same reported
// age in a training phase is a hang at once.
TEST_F(WorkersTest, ReportingTheResultIsAHangOnlyAfterFourTimeouts) {
  auto ids = Start(2);
  for (int t = 1; t <= 80; ++t) {
    clock_.Advance(100);
    Beat(ids[0], 150, "reporting", 900, 900, 5000 + 100 * t);
    Beat(ids[1], 150, "reporting", 900, 900, 5000 + 100 * t);
    EXPECT_TRUE(workers_.Detect().empty()) << t;
  }
  clock_.Advance(100);  // 8.1 s since the registration, above 4 x 2 s
  Beat(ids[0], 150, "reporting", 900, 900, 13100);
  Beat(ids[1], 150, "reporting", 900, 900, 13100);
  ExpectOneHang(0, "in phase reporting");
}

TEST_F(WorkersTest, ReportingAgesOnlyInATrainingPhaseAreAHangAtOnce) {
  auto ids = Start(2);
  clock_.Advance(100);
  Beat(ids[0], 150, "reporting", 900, 900, 5000);
  Beat(ids[1], 150, "optimizer", 900, 900, 5000);
  ExpectOneHang(1, "in phase optimizer");
}

TEST_F(WorkersTest, WaitingInACollectiveIsNeverTheCulprit) {
  auto ids = Start(2);
  // Both ranks in collective 3 forever (no one behind): a hang with no single rank, named
  // once they have waited hang_timeout + heartbeat_timeout (2 + 0.5 s), not before.
  AllWaitIn(ids, 1, 3, 0, 30, 25);
  std::vector<Finding> f = workers_.Detect();
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].failure.kind(), rackrun::v1::HANG);
  EXPECT_EQ(f[0].failure.rank(), -1);
}

TEST_F(WorkersTest, StoppedInsideTheCollectiveEveryRankEnteredIsNamed) {
  auto ids = Start(2);
  // Both ranks enter collective 6; rank 0 keeps waiting in it, rank 1 is SIGSTOPped inside
  // it 1.8 s later (its last heartbeat says it is in collective 6 too). When rank 0 has
  // waited past the hang timeout (2 s), rank 1 is not silent yet (0.5 s): that is no
  // reason to name no rank; once its heartbeats are overdue it is named.
  AllWaitIn(ids, 4, 6, 0, 18, 18);
  for (int t = 18; t < 40; ++t) {
    clock_.Advance(100);
    WaitingIn(ids[0], 4, 6, t);
    std::vector<Finding> f = workers_.Detect();
    if (!f.empty()) {
      ASSERT_EQ(f.size(), 1u);
      EXPECT_EQ(f[0].failure.kind(), rackrun::v1::HANG);
      EXPECT_EQ(f[0].failure.rank(), 1) << f[0].failure.message();
      EXPECT_EQ(f[0].failure.pid(), 1001);
      EXPECT_NE(f[0].failure.message().find("heartbeats stopped"), std::string::npos)
          << f[0].failure.message();
      return;
    }
  }
  FAIL() << "the stopped rank was never named";
}

TEST_F(WorkersTest, RanksInTheRendezvousNameTheRankTheyWaitFor) {
  auto ids = Start(3);
  // Ranks 0 and 2 wait for their peers in the data channel's rendezvous; rank 1 is still
  // starting (say, reading a slow file system). The waiting ranks have the longer phase
  // age, yet the rank they wait for is the one named, once they have waited past the
  // start timeout (2.5 s; the hang timeout is 2 s).
  for (int t = 1; t <= 25; ++t) {
    clock_.Advance(100);
    Beat(ids[0], 0, "connecting", 0, 0, 100 * t + 50);
    Beat(ids[1], 0, "starting", 0, 0, 100 * t);
    Beat(ids[2], 0, "connecting", 0, 0, 100 * t + 50);
    if (t < 25) {
      EXPECT_TRUE(workers_.Detect().empty()) << t;
    }
  }
  std::vector<Finding> f = workers_.Detect();
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].failure.kind(), rackrun::v1::HANG);
  EXPECT_EQ(f[0].failure.rank(), 1);
  EXPECT_EQ(f[0].failure.phase(), "starting");
  EXPECT_NE(f[0].failure.message().find("rank(s) 0, 2 wait in the data channel's rendezvous"),
            std::string::npos)
      << f[0].failure.message();
}

// They wait for the store and the network, not for a rank: named after the hang timeout
// plus the heartbeat timeout (2 + 0.5 s here), as every rank blocked in one collective.
TEST_F(WorkersTest, EveryRankInTheRendezvousNamesNoRank) {
  auto ids = Start(2);
  for (int t = 1; t <= 26; ++t) {
    clock_.Advance(100);
    Beat(ids[0], 0, "connecting", 0, 0, 100 * t);
    Beat(ids[1], 0, "connecting", 0, 0, 100 * t);
    if (t == 25) {
      EXPECT_TRUE(workers_.Detect().empty()) << "not before 2.5 s";
    }
  }
  std::vector<Finding> f = workers_.Detect();
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].failure.kind(), rackrun::v1::HANG);
  EXPECT_EQ(f[0].failure.rank(), -1);
  EXPECT_EQ(f[0].failure.phase(), "connecting");
}

// A worker whose attempt ended DRAINED shuts down: it is never idle again (so no restart
// is placed on it before its Deregister), is GONE when it deregisters and LOST when it
// falls silent first.
TEST_F(WorkersTest, ADrainedWorkerIsNeverIdleAgain) {
  auto ids = Start(3);
  workers_.SetDraining(ids[0], "j-1");
  workers_.SetIdle(ids[1], "j-1");
  workers_.SetDraining(ids[2], "another job");  // not its job: nothing changes
  std::vector<IdleWorker> idle = workers_.Idle();
  ASSERT_EQ(idle.size(), 1u);
  EXPECT_EQ(idle[0].worker_id, ids[1]);
  const auto state = [this](int i) { return workers_.List(true).workers(i).state(); };
  EXPECT_EQ(state(0), rackrun::v1::DRAINING);
  EXPECT_EQ(state(2), rackrun::v1::BUSY);
  workers_.SetIdle(ids[0], "");  // a late release does not make it idle either
  EXPECT_EQ(state(0), rackrun::v1::DRAINING);
  ASSERT_TRUE(workers_.Deregister(ids[0]).ok());
  EXPECT_EQ(state(0), rackrun::v1::GONE);
  // Draining and then silent (it died before deregistering): LOST.
  workers_.SetDraining(ids[2], "j-1");
  for (int t = 0; t < 6; ++t) {
    clock_.Advance(100);
    Beat(ids[1], 0, "idle", 0, 0);
  }
  EXPECT_TRUE(workers_.Detect().empty());
  EXPECT_EQ(state(2), rackrun::v1::LOST);
  EXPECT_EQ(state(1), rackrun::v1::IDLE);
}

TEST_F(WorkersTest, AssignmentsFlowAndIdleNeedsAStream) {
  rackrun::v1::RegisterRequest req;
  req.set_host("h");
  req.add_channels("ucx");
  req.add_channels("gloo");
  const std::string id = *workers_.Register(req);
  EXPECT_TRUE(workers_.Idle().empty());  // no stream yet
  const int64_t gen = *workers_.OpenStream(id);
  ASSERT_EQ(workers_.Idle().size(), 1u);
  rackrun::v1::Assignment a;
  a.mutable_cancel()->set_job_id("j-1");
  workers_.Push(id, a);
  auto got = workers_.NextAssignment(id, gen, absl::Milliseconds(10));
  ASSERT_TRUE(got.ok() && got->has_value());
  EXPECT_EQ((*got)->cancel().job_id(), "j-1");
  auto none = workers_.NextAssignment(id, gen, absl::Milliseconds(10));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  const int64_t newer = *workers_.OpenStream(id);
  EXPECT_EQ(workers_.NextAssignment(id, gen, absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kCancelled);
  workers_.CloseStream(id, gen);  // the superseded stream's close changes nothing
  EXPECT_EQ(workers_.Idle().size(), 1u);
  workers_.CloseStream(id, newer);
  EXPECT_TRUE(workers_.Idle().empty());
}

// Workers with a GPU that run a job are counted as busy GPU workers (the scheduler's "not
// placed" reason names them); idle ones, CPU workers and ended ones are not.
TEST_F(WorkersTest, BusyGpuWorkersCountsOnlyGpuWorkersRunningAJob) {
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    rackrun::v1::RegisterRequest req;
    req.set_host("h" + std::to_string(i));
    req.add_channels("ucx");
    if (i != 3) req.mutable_gpu()->set_name("NVIDIA H200");
    if (i == 0) req.mutable_gpu()->set_total_bytes(int64_t{141} << 30);
    ids.push_back(*workers_.Register(req));
    ASSERT_TRUE(workers_.OpenStream(ids.back()).ok());
  }
  EXPECT_EQ(workers_.BusyGpuWorkers(), 0);  // all idle
  // The scheduler sees each GPU and its memory (0 where the worker reported none).
  for (const IdleWorker& w : workers_.Idle()) {
    EXPECT_EQ(w.gpu, w.host != "h3") << w.host;
    EXPECT_EQ(w.gpu_bytes, w.host == "h0" ? int64_t{141} << 30 : 0) << w.host;
  }
  workers_.SetBusy(ids[0], "j-1", 1, 0);
  workers_.SetBusy(ids[1], "j-1", 1, 1);
  workers_.SetBusy(ids[3], "j-1", 1, 2);  // no GPU
  EXPECT_EQ(workers_.BusyGpuWorkers(), 2);
  workers_.SetIdle(ids[1], "j-1");
  EXPECT_EQ(workers_.BusyGpuWorkers(), 1);
  ASSERT_TRUE(workers_.Deregister(ids[0]).ok());
  EXPECT_EQ(workers_.BusyGpuWorkers(), 0);
}

// A worker cut off by a partition re-registers still running its attempt, which ended
// meanwhile (restarted elsewhere): it is IDLE but not placeable until a heartbeat says it
// stopped; one that is re-attached (SetBusy) is busy at once.
TEST_F(WorkersTest, AReRegisteredWorkerStillStoppingItsAttemptIsNotPlaced) {
  rackrun::v1::RegisterRequest req;
  req.set_host("h");
  req.set_worker_id("w-5");
  req.set_job_id("j-1");
  req.set_attempt(1);
  ASSERT_TRUE(workers_.Register(req).ok());
  ASSERT_TRUE(workers_.OpenStream("w-5").ok());
  EXPECT_EQ(workers_.List(false).workers(0).state(), rackrun::v1::IDLE);
  EXPECT_TRUE(workers_.Idle().empty());
  HeartbeatRequest hb;
  hb.set_worker_id("w-5");
  hb.set_job_id("j-1");  // still stopping
  hb.set_attempt(1);
  hb.set_phase("forward");
  ASSERT_TRUE(workers_.Heartbeat(hb).ok());
  EXPECT_TRUE(workers_.Idle().empty());
  hb.clear_job_id();
  hb.set_attempt(0);
  hb.set_phase("idle");
  ASSERT_TRUE(workers_.Heartbeat(hb).ok());
  ASSERT_EQ(workers_.Idle().size(), 1u);
  EXPECT_EQ(workers_.Idle()[0].worker_id, "w-5");

  // Re-attached to the attempt it names: busy, and placeable again once released.
  ASSERT_TRUE(workers_.Register(req).ok());
  ASSERT_TRUE(workers_.OpenStream("w-5").ok());
  workers_.SetBusy("w-5", "j-1", 1, 0);
  EXPECT_EQ(workers_.List(false).workers(0).state(), rackrun::v1::BUSY);
  workers_.SetIdle("w-5", "j-1");
  EXPECT_EQ(workers_.Idle().size(), 1u);
}

// A worker whose attempt ended here while it was cut off (named HANG, then released) goes on
// heartbeating that attempt until it has stopped and reported it: it is IDLE but not placed
// until a heartbeat names no job (tests/netns: ACutHostIsNamedAndTheJobRestartsOnASpareHost
// once placed the next job on it, which then waited behind the old attempt's report).
TEST_F(WorkersTest, AnIdleWorkerStillHeartbeatingAnEndedAttemptIsNotPlaced) {
  auto ids = Start(1);
  workers_.SetIdle(ids[0], "j-1");  // the attempt ended (its rank was named)
  ASSERT_EQ(workers_.Idle().size(), 1u);
  Beat(ids[0], 5, "reporting", 10, 10);  // its heartbeats still name j-1
  EXPECT_EQ(workers_.List(false).workers(0).state(), rackrun::v1::IDLE);
  EXPECT_TRUE(workers_.Idle().empty());
  HeartbeatRequest hb;
  hb.set_worker_id(ids[0]);
  hb.set_phase("idle");
  ASSERT_TRUE(workers_.Heartbeat(hb).ok());
  ASSERT_EQ(workers_.Idle().size(), 1u);
  // A busy worker's heartbeat naming its job changes nothing.
  workers_.SetBusy(ids[0], "j-2", 1, 0);
  Beat(ids[0], 0, "forward", 0, 0);
  workers_.SetIdle(ids[0], "j-2");
  EXPECT_EQ(workers_.Idle().size(), 1u);
}

// The rack label travels from the registration to the scheduler's candidates, the rank
// placements and ListWorkers; a label outside the rule is refused naming the field.
TEST_F(WorkersTest, RackLabelIsKeptAndCheckedAtRegistration) {
  rackrun::v1::RegisterRequest req;
  req.set_host("h");
  req.add_channels("gloo");
  req.set_rack("rack a");
  const absl::StatusOr<std::string> bad = workers_.Register(req);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("rack: the rack label 'rack a'"),
            std::string::npos)
      << bad.status();
  req.set_rack("rack-a");
  const absl::StatusOr<std::string> id = workers_.Register(req);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(workers_.OpenStream(*id).ok());
  const std::vector<IdleWorker> idle = workers_.Idle();
  ASSERT_EQ(idle.size(), 1u);
  EXPECT_EQ(idle[0].rack, "rack-a");
  EXPECT_EQ(workers_.Placement(*id)->rack(), "rack-a");
  const rackrun::v1::ListWorkersResponse listed = workers_.List(false);
  ASSERT_EQ(listed.workers_size(), 1);
  EXPECT_EQ(listed.workers(0).rack(), "rack-a");
}

// A link cut on a fake clock, with the daemon tests' timings (heartbeat every 200 ms, lost
// and hung after 3 s; rpc/liveness.h: heartbeat deadline and retry 750 ms, a rank late
// after 950 ms, survivable cut 2.05 s). A cut rank's heartbeats stop with the cut and
// resume 750 ms after the link is back (the first attempt over a new connection; the
// worst case of the derivation); data its collective waits for arrives after TCP's
// backoff, 2 x the cut + 0.2 s after the cut began. Below the bound nothing may be
// named; a cut well above it names the cut rank.
class LinkCutTest : public ::testing::Test {
 protected:
  LinkCutTest()
      : workers_(clock_.clock(), Workers::Options{200, 3000, 3000, 600000},
                 [this]() -> absl::StatusOr<int64_t> { return ++next_; }) {}

  // What a rank reports from `from_ms` on (until the next report's from_ms).
  struct Report {
    int64_t from_ms;
    std::string phase;
    int64_t entered, completed;
  };
  struct Script {
    std::vector<Report> reports;
    int64_t quiet_from = -1, quiet_to = -1;  // no heartbeat arrives in [quiet_from, quiet_to)
  };

  // Ranks 0..n-1 follow their scripts from 0 to `end_ms` in 100 ms ticks (heartbeats on
  // even ticks); the first finding and when it came, or nullopt.
  std::optional<std::pair<int64_t, Finding>> Run(const std::vector<Script>& scripts,
                                                 int64_t end_ms) {
    std::vector<std::string> ids;
    for (size_t r = 0; r < scripts.size(); ++r) {
      rackrun::v1::RegisterRequest req;
      req.set_host("host" + std::to_string(r));
      absl::StatusOr<std::string> id = workers_.Register(req);
      EXPECT_TRUE(id.ok());
      EXPECT_TRUE(workers_.OpenStream(*id).ok());
      workers_.SetBusy(*id, "j-1", 1, static_cast<int>(r));
      ids.push_back(*id);
    }
    for (int64_t t = 0; t <= end_ms; t += 100) {
      for (size_t r = 0; r < scripts.size(); ++r) {
        const Script& s = scripts[r];
        if (t % 200 != 0 || (t >= s.quiet_from && t < s.quiet_to)) continue;
        const Report* now = &s.reports.front();
        for (const Report& x : s.reports) {
          if (x.from_ms <= t) now = &x;
        }
        HeartbeatRequest hb;
        hb.set_worker_id(ids[r]);
        hb.set_job_id("j-1");
        hb.set_attempt(1);
        hb.set_phase(now->phase);
        hb.set_collectives_entered(now->entered);
        hb.set_collectives_completed(now->completed);
        hb.set_phase_age_ms(t - now->from_ms);
        EXPECT_TRUE(workers_.Heartbeat(hb).ok());
      }
      std::vector<Finding> f = workers_.Detect();
      if (!f.empty()) return std::make_pair(t, f[0]);
      clock_.Advance(100);
    }
    return std::nullopt;
  }

  testing::FakeClock clock_;
  int64_t next_ = 0;
  Workers workers_;
};

// Rank 1's link is cut for 2 s (below the 2.05 s bound) while rank 0's data of collective
// 5 is on its way to it: rank 0 completed 5 and waits in 6 from then on; rank 1 heartbeats
// again at 2.75 s, waiting in collective 5 itself, and the data arrives at 4.2 s. Rank 0
// waits 4.2 s, past the 3 s hang timeout, for a rank that is behind but waits for data:
// the transport hold (failure_detector.h, hang (a)) names nothing. (Before: HANG naming
// rank 1 at 3.1 s, as in issue 37's netns runs.)
TEST_F(LinkCutTest, AWorkerCutBelowTheBoundWhoseDataRetransmitsIsNotNamed) {
  const std::vector<Script> scripts = {
      {{{0, "collective", 6, 5}, {4200, "forward", 6, 6}}},
      {{{0, "forward", 4, 4}, {100, "collective", 5, 4}, {4200, "forward", 6, 6}}, 0, 2750},
  };
  const auto found = Run(scripts, 6700);  // until the last reports are 2.5 s old
  EXPECT_FALSE(found.has_value()) << found->first << " ms: " << found->second.failure.message();
}

// The same rank is still computing (its last report: forward, collective 5 done) when
// its link is cut 1 s into rank 0's wait; it enters collective 6 during the cut and
// reports that at 3.75 s. At 3.1 s rank 0 has waited past the hang timeout while rank 1's
// last report (2.1 s old: late, not silent) says it is behind: a stale report names no one.
TEST_F(LinkCutTest, ALateRanksStaleReportIsNotNamed) {
  const std::vector<Script> scripts = {
      {{{0, "collective", 6, 5}, {5200, "forward", 6, 6}}},
      {{{0, "forward", 5, 5}, {1500, "collective", 6, 5}, {5200, "forward", 6, 6}}, 1000, 3750},
  };
  const auto found = Run(scripts, 7700);
  EXPECT_FALSE(found.has_value()) << found->first << " ms: " << found->second.failure.message();
}

// Both ranks in the data channel's rendezvous when rank 1's link is cut for 2 s: rank 0
// waits in it 3.6 s (the cut, then two heartbeat deadlines for the rendezvous client's
// next slice over a new connection), past the hang timeout; every rank is in it, so the
// rule waits the heartbeat timeout more and names nothing.
TEST_F(LinkCutTest, AWorkerCutBelowTheBoundDuringTheRendezvousIsNotNamed) {
  const std::vector<Script> scripts = {
      {{{0, "connecting", 0, 0}, {3600, "forward", 1, 1}}},
      {{{0, "connecting", 0, 0}, {3600, "forward", 1, 1}}, 0, 2750},
  };
  const auto found = Run(scripts, 6100);
  EXPECT_FALSE(found.has_value()) << found->first << " ms: " << found->second.failure.message();
}

// Rank 1's link cut for 5 s, well above the bound: its heartbeats are overdue at 3 s and
// rank 0 has waited past the hang timeout at 3.1 s: HANG naming rank 1, the silent one.
TEST_F(LinkCutTest, AWorkerCutWellAboveTheBoundIsNamed) {
  const std::vector<Script> scripts = {
      {{{0, "collective", 6, 5}}},
      {{{0, "forward", 4, 4}, {100, "collective", 5, 4}}, 100, 5750},
  };
  const auto found = Run(scripts, 9000);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->first, 3100);
  EXPECT_EQ(found->second.failure.kind(), rackrun::v1::HANG);
  EXPECT_EQ(found->second.failure.rank(), 1);
  EXPECT_NE(found->second.failure.message().find("heartbeats stopped"), std::string::npos)
      << found->second.failure.message();
}

}  // namespace
}  // namespace rackrun::coordinator
