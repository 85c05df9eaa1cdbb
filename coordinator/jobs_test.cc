#include "coordinator/jobs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "coordinator/test_util.h"
#include "jobspec/restart_policy.h"

namespace rackrun::coordinator {
namespace {

using rackrun::v1::AttemptResult;
using rackrun::v1::Failure;
using rackrun::v1::JobEvent;
using rackrun::v1::JobSpec;
using rackrun::v1::RankPlacement;

JobSpec Spec(int ranks, int max_attempts = 1) {
  JobSpec s;
  s.set_name("t");
  s.mutable_resources()->set_ranks(ranks);
  s.mutable_restart()->set_max_attempts(max_attempts);
  return s;
}

std::vector<RankPlacement> Ranks(int n) {
  std::vector<RankPlacement> out;
  for (int r = 0; r < n; ++r) {
    RankPlacement p;
    p.set_rank(r);
    p.set_worker_id(absl::StrCat("w-", r + 1));
    p.set_host("h");
    p.set_pid(100 + r);
    out.push_back(p);
  }
  return out;
}

AttemptResult Result(AttemptResult::Outcome o, int64_t step = 10) {
  AttemptResult r;
  r.set_outcome(o);
  r.set_step(step);
  return r;
}

Failure Lost(int rank) {
  Failure f;
  f.set_kind(rackrun::v1::WORKER_LOST);
  f.set_rank(rank);
  f.set_phase("forward");
  return f;
}

class JobsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = JobStore::Open(dir_.path() + "/coordinator.db");
    ASSERT_TRUE(s.ok());
    store_ = *std::move(s);
    jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), Jobs::Options{5000});
    ASSERT_TRUE(jobs_->Initialize({}).ok());
  }
  // Every event of the job, checking seq is 1, 2, ... in memory and in the store.
  std::vector<JobEvent> Events(const std::string& id) {
    std::vector<JobEvent> ev;
    bool done = false;
    EXPECT_TRUE(jobs_->WaitEvents(id, 0, absl::ZeroDuration(), &ev, &done).ok());
    for (size_t i = 0; i < ev.size(); ++i) EXPECT_EQ(ev[i].seq(), static_cast<int64_t>(i + 1));
    auto all = store_->LoadAll();
    for (const StoredJob& sj : *all) {
      if (sj.job.id() != id) continue;
      EXPECT_EQ(sj.events.size(), ev.size());
      for (size_t i = 0; i < sj.events.size(); ++i) {
        EXPECT_EQ(sj.events[i].seq(), static_cast<int64_t>(i + 1));
      }
    }
    return ev;
  }

  testing::ScratchDir dir_;
  testing::FakeClock clock_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<Jobs> jobs_;
};

TEST_F(JobsTest, LifecycleToSucceeded) {
  auto sub = jobs_->Submit(Spec(2), "r1");
  ASSERT_TRUE(sub.ok());
  const std::string id = sub->job.id();
  EXPECT_EQ(jobs_->Queue().size(), 1u);
  auto a = jobs_->StartAttempt(id, Ranks(2));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->number(), 1);
  EXPECT_TRUE(jobs_->Queue().empty());
  EXPECT_TRUE(jobs_->AttemptRunning(id, 1));
  auto r0 = jobs_->RankResult(id, 1, 0, Result(AttemptResult::SUCCEEDED));
  ASSERT_TRUE(r0.ok());
  EXPECT_EQ(r0->job.state(), rackrun::v1::RUNNING);
  auto r1 = jobs_->RankResult(id, 1, 1, Result(AttemptResult::SUCCEEDED));
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->job.state(), rackrun::v1::SUCCEEDED);
  EXPECT_EQ(r1->job.attempts(0).state(), rackrun::v1::SUCCEEDED);
  std::vector<JobEvent> ev = Events(id);
  EXPECT_EQ(ev.front().state(), rackrun::v1::QUEUED);
  EXPECT_EQ(ev.back().state(), rackrun::v1::SUCCEEDED);
  EXPECT_EQ(jobs_->Cancel(id, "").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(jobs_->Cancel("j-99", "").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(JobsTest, SubmitIsIdempotent) {
  auto a = jobs_->Submit(Spec(1), "same");
  auto b = jobs_->Submit(Spec(1), "same");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(a->created);
  EXPECT_FALSE(b->created);
  EXPECT_EQ(a->job.id(), b->job.id());
  EXPECT_EQ(jobs_->Queue().size(), 1u);
}

TEST_F(JobsTest, FailureWithoutRestartFailsJobAndCancelsTheOthers) {
  const std::string id = jobs_->Submit(Spec(3), "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(3)).ok());
  ASSERT_TRUE(jobs_->RankResult(id, 1, 2, Result(AttemptResult::SUCCEEDED)).ok());
  auto ended = jobs_->FailAttempt(id, 1, Lost(1));
  ASSERT_TRUE(ended.ok());
  EXPECT_EQ(ended->job.state(), rackrun::v1::FAILED);
  EXPECT_EQ(ended->job.first_failure().rank(), 1);
  ASSERT_EQ(ended->to_cancel.size(), 2u);  // ranks 0 and 1 had not reported
  EXPECT_EQ(ended->to_cancel[0].rank, 0);
  EXPECT_EQ(ended->to_cancel[1].rank, 1);
  // A second detector naming the same attempt changes nothing.
  auto again = jobs_->FailAttempt(id, 1, Lost(0));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->to_cancel.empty());
  EXPECT_EQ(again->job.first_failure().rank(), 1);
  Events(id);
}

TEST_F(JobsTest, RestartPolicyAndBackoff) {
  JobSpec spec = Spec(1, 3);
  spec.mutable_restart()->set_backoff_s(2);
  const std::string id = jobs_->Submit(spec, "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(1)).ok());
  auto e1 = jobs_->FailAttempt(id, 1, Lost(0));
  ASSERT_TRUE(e1.ok());
  EXPECT_EQ(e1->job.state(), rackrun::v1::QUEUED);
  EXPECT_EQ(e1->job.restarts(), 1);
  ASSERT_EQ(jobs_->Queue().size(), 1u);
  EXPECT_EQ(jobs_->Queue()[0].not_before_ms, clock_.now() + 2000);
  auto a2 = jobs_->StartAttempt(id, Ranks(1));
  ASSERT_TRUE(a2.ok());
  EXPECT_EQ(a2->number(), 2);
  Failure hang = Lost(0);
  hang.set_kind(rackrun::v1::HANG);
  auto e2 = jobs_->FailAttempt(id, 2, hang);
  EXPECT_EQ(e2->job.state(), rackrun::v1::QUEUED);
  EXPECT_EQ(jobs_->Queue()[0].not_before_ms, clock_.now() + 4000);  // doubled
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(1)).ok());
  auto e3 = jobs_->FailAttempt(id, 3, Lost(0));
  EXPECT_EQ(e3->job.state(), rackrun::v1::FAILED);  // max_attempts reached
  EXPECT_EQ(e3->job.attempts_size(), 3);
  EXPECT_EQ(e3->job.first_failure().kind(), rackrun::v1::WORKER_LOST);
  EXPECT_EQ(e3->job.attempts(1).failure().kind(), rackrun::v1::HANG);
  Events(id);
}

TEST_F(JobsTest, ErrorsDoNotRestartByDefault) {
  const std::string id = jobs_->Submit(Spec(2, 5), "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(2)).ok());
  AttemptResult bad = Result(AttemptResult::FAILED, 4);
  bad.set_message("NaN loss");
  bad.set_phase("forward");
  auto e = jobs_->RankResult(id, 1, 1, bad);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->job.state(), rackrun::v1::FAILED);
  EXPECT_EQ(e->job.first_failure().kind(), rackrun::v1::ERROR);
  EXPECT_EQ(e->job.first_failure().rank(), 1);
  EXPECT_EQ(e->job.first_failure().worker_id(), "w-2");
  EXPECT_EQ(e->job.first_failure().step(), 4);
  ASSERT_EQ(e->to_cancel.size(), 1u);
  EXPECT_EQ(e->to_cancel[0].worker_id, "w-1");
}

TEST_F(JobsTest, RestartOnErrorWhenListed) {
  JobSpec spec = Spec(1, 2);
  spec.mutable_restart()->add_on("error");
  const std::string id = jobs_->Submit(spec, "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(1)).ok());
  auto e = jobs_->RankResult(id, 1, 0, Result(AttemptResult::FAILED));
  EXPECT_EQ(e->job.state(), rackrun::v1::QUEUED);
  // Only `error` is listed now: a lost worker does not restart.
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(1)).ok());
  JobSpec lost_only = Spec(1, 5);
  lost_only.mutable_restart()->add_on("bogus");
  EXPECT_EQ(jobspec::RestartPolicyOf(lost_only).status().code(),
            absl::StatusCode::kInvalidArgument);
}

Failure HangOf(int rank, const std::string& phase) {
  Failure f;
  f.set_kind(rackrun::v1::HANG);
  f.set_rank(rank);
  f.set_worker_id(absl::StrCat("w-", rank + 1));
  f.set_phase(phase);
  f.set_message("in phase " + phase + " for 3.006 s (hang timeout 3 s)");
  return f;
}

// A slow machine: the phase rule named rank 0 while it was still starting; its own
// out-of-memory report came 2 s later, within the grace, and is what the job records.
TEST_F(JobsTest, OwnReportWithinTheGraceReplacesTheHangVerdict) {
  const std::string id = jobs_->Submit(Spec(2), "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(2)).ok());
  ASSERT_EQ(jobs_->FailAttempt(id, 1, HangOf(0, "starting"))->job.state(), rackrun::v1::FAILED);
  clock_.Advance(2000);
  AttemptResult oom = Result(AttemptResult::FAILED, 0);
  oom.set_message("out of memory: an allocation failed");
  oom.set_phase("starting");
  // A peer's late result is not the named rank's: nothing changes.
  ASSERT_EQ(jobs_->RankResult(id, 1, 1, oom)->job.first_failure().kind(), rackrun::v1::HANG);
  auto e = jobs_->RankResult(id, 1, 0, oom);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->job.state(), rackrun::v1::FAILED);
  EXPECT_EQ(e->job.first_failure().kind(), rackrun::v1::ERROR);
  EXPECT_EQ(e->job.first_failure().rank(), 0);
  EXPECT_EQ(e->job.first_failure().message(), "out of memory: an allocation failed");
  EXPECT_NE(e->job.first_failure().replaced_verdict().find("hang: rank 0"), std::string::npos)
      << e->job.first_failure().replaced_verdict();
  EXPECT_EQ(e->job.attempts(0).failure().message(), "out of memory: an allocation failed");
  EXPECT_NE(e->job.message().find("out of memory"), std::string::npos) << e->job.message();
  EXPECT_TRUE(e->to_cancel.empty());
  std::vector<JobEvent> ev = Events(id);
  EXPECT_NE(ev.back().message().find("replaces it"), std::string::npos) << ev.back().DebugString();
  // Replaced once: a second report changes nothing.
  oom.set_message("again");
  EXPECT_EQ(jobs_->RankResult(id, 1, 0, oom)->job.first_failure().message(),
            "out of memory: an allocation failed");
  // Durable: the store has the replacement.
  absl::StatusOr<std::vector<StoredJob>> stored = store_->LoadAll();
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->size(), 1u);
  EXPECT_EQ(stored->front().job.first_failure().kind(), rackrun::v1::ERROR);
}

TEST_F(JobsTest, OwnReportAfterTheGraceLeavesTheVerdict) {
  const std::string id = jobs_->Submit(Spec(1), "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(1)).ok());
  ASSERT_TRUE(jobs_->FailAttempt(id, 1, HangOf(0, "forward")).ok());
  clock_.Advance(Jobs::Options{}.report_grace_ms + 1);
  auto e = jobs_->RankResult(id, 1, 0, Result(AttemptResult::FAILED));
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->job.first_failure().kind(), rackrun::v1::HANG);
  EXPECT_TRUE(e->job.first_failure().replaced_verdict().empty());
}

// The verdict restarted the job (hang is in restart.on by default, error is not): the
// rank's own error, arriving before the next attempt started, fails the job instead.
TEST_F(JobsTest, OwnErrorReplacingARestartingVerdictFailsTheQueuedJob) {
  const std::string id = jobs_->Submit(Spec(1, 3), "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(1)).ok());
  ASSERT_EQ(jobs_->FailAttempt(id, 1, HangOf(0, "starting"))->job.state(), rackrun::v1::QUEUED);
  clock_.Advance(500);
  auto e = jobs_->RankResult(id, 1, 0, Result(AttemptResult::FAILED, 0));
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->job.state(), rackrun::v1::FAILED);
  EXPECT_EQ(e->job.first_failure().kind(), rackrun::v1::ERROR);
  EXPECT_NE(e->job.message().find("not restarted"), std::string::npos) << e->job.message();
  EXPECT_TRUE(jobs_->Queue().empty());
  EXPECT_EQ(Events(id).back().state(), rackrun::v1::FAILED);
}

TEST_F(JobsTest, WatchReplaysFromSeqAndFollowsLive) {
  const std::string id = jobs_->Submit(Spec(1), "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(1)).ok());
  const int64_t seen = Events(id).back().seq();
  std::vector<JobEvent> got;
  std::thread watcher([&] {
    int64_t after = 1;  // replay everything after the QUEUED event, then live
    bool done = false;
    while (!done) {
      std::vector<JobEvent> ev;
      ASSERT_TRUE(jobs_->WaitEvents(id, after, absl::Seconds(10), &ev, &done).ok());
      for (const JobEvent& e : ev) {
        got.push_back(e);
        after = e.seq();
      }
    }
  });
  rackrun::v1::StepProgress p;
  p.set_step(1);
  ASSERT_TRUE(jobs_->Progress(id, 1, p).ok());
  ASSERT_TRUE(jobs_->RankResult(id, 1, 0, Result(AttemptResult::SUCCEEDED)).ok());
  watcher.join();
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.front().seq(), 2);
  for (size_t i = 1; i < got.size(); ++i) EXPECT_EQ(got[i].seq(), got[i - 1].seq() + 1);
  EXPECT_GT(got.back().seq(), seen);
  EXPECT_EQ(got.back().state(), rackrun::v1::SUCCEEDED);
  bool saw_progress = false;
  for (const JobEvent& e : got) saw_progress |= e.has_progress();
  EXPECT_TRUE(saw_progress);
}

// A placement that mixes rack labels is a message event of the attempt; a rank whose worker
// re-attaches with another rack label keeps its domain and takes the new label; another
// worker naming the rank is refused.
TEST_F(JobsTest, PlacementNoteIsAnEventAndReattachKeepsTheDomain) {
  const std::string id = jobs_->Submit(Spec(4), "r1")->job.id();
  std::vector<RankPlacement> ranks = Ranks(4);
  for (RankPlacement& r : ranks) {
    r.set_domain(r.rank() / 2);
    r.set_rack(r.rank() < 3 ? "a" : "b");
  }
  const std::string note = "placement: domain 1 spans racks a, b (test)";
  ASSERT_TRUE(jobs_->StartAttempt(id, ranks, note).ok());
  bool noted = false;
  for (const JobEvent& e : Events(id)) noted |= e.message() == note && e.attempt() == 1;
  EXPECT_TRUE(noted);
  EXPECT_EQ(jobs_->Get(id)->attempts(0).ranks(3).domain(), 1);
  RankPlacement moved;
  moved.set_rank(3);
  moved.set_worker_id("w-4");  // rank 3's worker, registered again with another rack label
  moved.set_host("h2");
  moved.set_pid(900);
  moved.set_rack("c");
  ASSERT_TRUE(jobs_->Reattach(id, 1, 3, moved).ok());
  RankPlacement now = jobs_->Get(id)->attempts(0).ranks(3);
  EXPECT_EQ(now.worker_id(), "w-4");
  EXPECT_EQ(now.rack(), "c");
  EXPECT_EQ(now.domain(), 1);
  // Another worker naming the rank does not take it.
  moved.set_worker_id("w-9");
  const absl::Status other = jobs_->Reattach(id, 1, 3, moved);
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.message().find("runs on worker w-4, not on w-9"), std::string::npos) << other;
  now = jobs_->Get(id)->attempts(0).ranks(3);
  EXPECT_EQ(now.worker_id(), "w-4");
  // Without a note there is no such event.
  const std::string plain = jobs_->Submit(Spec(1), "r2")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(plain, Ranks(1)).ok());
  for (const JobEvent& e : Events(plain))
    EXPECT_EQ(e.message().find("placement:"), std::string::npos);
}

TEST_F(JobsTest, ReattachAfterRestartOrLoseWithinGrace) {
  std::string kept, lost;
  kept = jobs_->Submit(Spec(2), "kept")->job.id();
  lost = jobs_->Submit(Spec(2), "lost")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(kept, Ranks(2)).ok());
  ASSERT_TRUE(jobs_->StartAttempt(lost, Ranks(2)).ok());
  // The coordinator restarts: a new Jobs from the same store.
  auto all = store_->LoadAll();
  ASSERT_TRUE(all.ok());
  jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), Jobs::Options{5000});
  ASSERT_TRUE(jobs_->Initialize(*std::move(all)).ok());
  EXPECT_EQ(jobs_->Get(kept)->state(), rackrun::v1::RUNNING);
  RankPlacement p = Ranks(2)[0];
  ASSERT_TRUE(jobs_->Reattach(kept, 1, 0, p).ok());
  p = Ranks(2)[1];
  ASSERT_TRUE(jobs_->Reattach(kept, 1, 1, p).ok());
  ASSERT_TRUE(jobs_->Reattach(lost, 1, 1, p).ok());
  EXPECT_EQ(jobs_->Reattach(lost, 2, 1, p).code(), absl::StatusCode::kFailedPrecondition);
  clock_.Advance(4999);
  EXPECT_TRUE(jobs_->ExpireReattach().empty());
  clock_.Advance(2);
  std::vector<Jobs::Ended> ended = jobs_->ExpireReattach();
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].job.id(), lost);
  EXPECT_EQ(ended[0].job.state(), rackrun::v1::FAILED);
  EXPECT_EQ(ended[0].job.first_failure().kind(), rackrun::v1::WORKER_LOST);
  EXPECT_EQ(ended[0].job.first_failure().rank(), 0);
  ASSERT_EQ(ended[0].to_cancel.size(), 2u);  // both ranks still owe a result
  EXPECT_EQ(jobs_->Get(kept)->state(), rackrun::v1::RUNNING);
  Events(lost);
}

// A rank's result is its re-attach: after a coordinator restart a rank that reports before
// it registers again is not awaited (before, the grace ran out naming it WORKER_LOST while
// the other rank still ran), and a rank that finished before the restart (a stored RankDone)
// is neither awaited nor asked again. A result sent twice is one event.
TEST_F(JobsTest, AFinishedRankIsNeitherAwaitedNorForgottenAcrossARestart) {
  const std::string before = jobs_->Submit(Spec(2), "before")->job.id();
  const std::string after = jobs_->Submit(Spec(2), "after")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(before, Ranks(2)).ok());
  ASSERT_TRUE(jobs_->StartAttempt(after, Ranks(2)).ok());
  ASSERT_TRUE(jobs_->RankResult(before, 1, 1, Result(AttemptResult::SUCCEEDED, 12)).ok());
  ASSERT_TRUE(jobs_->RankResult(before, 1, 1, Result(AttemptResult::SUCCEEDED, 12)).ok());
  EXPECT_EQ(jobs_->Get(before)->state(), rackrun::v1::RUNNING);
  // The coordinator restarts: a new Jobs from the same store.
  auto all = store_->LoadAll();
  ASSERT_TRUE(all.ok());
  jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), Jobs::Options{5000});
  ASSERT_TRUE(jobs_->Initialize(*std::move(all)).ok());
  ASSERT_TRUE(jobs_->Reattach(before, 1, 0, Ranks(2)[0]).ok());
  EXPECT_EQ(jobs_->Reattach(before, 1, 1, Ranks(2)[1]).code(),
            absl::StatusCode::kFailedPrecondition);  // it has finished
  // `after`: rank 0's result arrives before it registers again; rank 1 re-attaches.
  ASSERT_TRUE(jobs_->RankResult(after, 1, 0, Result(AttemptResult::SUCCEEDED, 12)).ok());
  ASSERT_TRUE(jobs_->Reattach(after, 1, 1, Ranks(2)[1]).ok());
  EXPECT_EQ(jobs_->Reattach(after, 1, 0, Ranks(2)[0]).code(),
            absl::StatusCode::kFailedPrecondition);
  clock_.Advance(5001);
  EXPECT_TRUE(jobs_->ExpireReattach().empty());
  EXPECT_EQ(jobs_->Get(before)->state(), rackrun::v1::RUNNING);
  EXPECT_EQ(jobs_->Get(after)->state(), rackrun::v1::RUNNING);
  ASSERT_TRUE(jobs_->RankResult(before, 1, 0, Result(AttemptResult::SUCCEEDED, 12)).ok());
  ASSERT_TRUE(jobs_->RankResult(after, 1, 1, Result(AttemptResult::SUCCEEDED, 12)).ok());
  EXPECT_EQ(jobs_->Get(before)->state(), rackrun::v1::SUCCEEDED);
  EXPECT_EQ(jobs_->Get(after)->state(), rackrun::v1::SUCCEEDED);
  for (const std::string& id : {before, after}) {
    std::vector<int> done;
    for (const JobEvent& e : Events(id)) {
      if (!e.has_rank_done()) continue;
      done.push_back(e.rank_done().rank());
      EXPECT_EQ(e.rank_done().step(), 12);
      EXPECT_EQ(e.attempt(), 1);
    }
    std::sort(done.begin(), done.end());
    EXPECT_EQ(done, (std::vector<int>{0, 1})) << id;
  }
}

// The steps of the job's progress events (memory and store agree on them).
std::vector<int64_t> ProgressSteps(Jobs& jobs, JobStore& store, const std::string& id) {
  std::vector<JobEvent> ev;
  bool done = false;
  EXPECT_TRUE(jobs.WaitEvents(id, 0, absl::ZeroDuration(), &ev, &done).ok());
  std::vector<int64_t> steps, stored;
  for (const JobEvent& e : ev)
    if (e.has_progress()) steps.push_back(e.progress().step());
  absl::StatusOr<std::vector<StoredJob>> all = store.LoadAll();
  EXPECT_TRUE(all.ok());
  if (!all.ok()) return steps;
  for (const StoredJob& sj : *all) {
    if (sj.job.id() != id) continue;
    for (const JobEvent& e : sj.events)
      if (e.has_progress()) stored.push_back(e.progress().step());
  }
  EXPECT_EQ(steps, stored);
  return steps;
}

// Progress reports become events at most once per progress_event_interval_ms (the newest
// kept back is in the job at once, and an event before the job's next other event); a job
// keeps at most max_progress_events of them, dropping the oldest but never the one before
// a checkpoint, so a restart after a coordinator restart still resumes there; an older
// coordinator's longer history is trimmed when it is loaded.
TEST_F(JobsTest, ProgressEventsAreThinnedAndBounded) {
  Jobs::Options o{5000};
  o.progress_event_interval_ms = 1000;
  o.max_progress_events = 5;
  jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), o);
  ASSERT_TRUE(jobs_->Initialize({}).ok());
  const std::string id = jobs_->Submit(Spec(1, 3), "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(1)).ok());
  rackrun::v1::StepProgress p;
  int64_t step = 0;
  const auto report = [&](int64_t advance_ms) {
    clock_.Advance(advance_ms);
    p.set_step(++step);
    ASSERT_TRUE(jobs_->Progress(id, 1, p).ok());
    EXPECT_EQ(jobs_->Get(id)->last_progress().step(), step);  // the job shows it at once
  };
  for (int i = 0; i < 10; ++i) report(i == 0 ? 0 : 100);  // steps 1-10 within 0.9 s
  report(100);                                            // step 11, 1 s after step 1
  EXPECT_EQ(ProgressSteps(*jobs_, *store_, id), (std::vector<int64_t>{1, 11}));
  for (int i = 0; i < 20; ++i) report(1000);  // steps 12-31, each an event
  EXPECT_EQ(ProgressSteps(*jobs_, *store_, id), (std::vector<int64_t>{27, 28, 29, 30, 31}));
  report(100);                                                  // step 32, kept back ...
  ASSERT_TRUE(jobs_->Checkpoint(id, 1, "/ckpt/step-32").ok());  // ... an event before it
  EXPECT_EQ(ProgressSteps(*jobs_, *store_, id), (std::vector<int64_t>{28, 29, 30, 31, 32}));
  for (int i = 0; i < 10; ++i) report(1000);  // steps 33-42
  EXPECT_EQ(ProgressSteps(*jobs_, *store_, id), (std::vector<int64_t>{32, 39, 40, 41, 42}));

  // The coordinator restarts (its rank never re-attaches): the restart resumes at step 32.
  absl::StatusOr<std::vector<StoredJob>> all = store_->LoadAll();
  ASSERT_TRUE(all.ok());
  jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), o);
  ASSERT_TRUE(jobs_->Initialize(*std::move(all)).ok());
  clock_.Advance(5001);
  ASSERT_EQ(jobs_->ExpireReattach().size(), 1u);
  absl::StatusOr<rackrun::v1::Attempt> a2 = jobs_->StartAttempt(id, Ranks(1));
  ASSERT_TRUE(a2.ok()) << a2.status();
  EXPECT_EQ(a2->start_step(), 32);

  // A coordinator that kept 3 loads the history of one that kept 5: trimmed to 3, the one
  // before the checkpoint kept.
  o.max_progress_events = 3;
  o.max_ended_progress_events = 2;
  all = store_->LoadAll();
  ASSERT_TRUE(all.ok());
  jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), o);
  ASSERT_TRUE(jobs_->Initialize(*std::move(all)).ok());
  EXPECT_EQ(ProgressSteps(*jobs_, *store_, id), (std::vector<int64_t>{32, 41, 42}));
  // Once the job has ended, at most max_ended_progress_events stay (its end is an event
  // after the last progress, so that one stays too).
  ASSERT_TRUE(jobs_->Cancel(id, "done").ok());
  ASSERT_TRUE(IsTerminal(jobs_->Get(id)->state())) << jobs_->Get(id)->DebugString();
  EXPECT_EQ(ProgressSteps(*jobs_, *store_, id), (std::vector<int64_t>{32, 42}));
}

// Ended jobs beyond max_ended_in_memory leave memory (the first to end first) and stay in
// the store: Get, the events, List and its pages, Cancel, a late report and a repeated
// submission see them as before; a coordinator restart loads only the live ones and the
// last to end; a watcher whose job ends and is forgotten while it waits still gets its end.
TEST_F(JobsTest, EndedJobsBeyondTheBoundLeaveMemoryAndAreReadBack) {
  Jobs::Options o{5000};
  o.max_ended_in_memory = 2;
  jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), o);
  ASSERT_TRUE(jobs_->Initialize({}).ok());
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(jobs_->Submit(Spec(1), absl::StrCat("r", i))->job.id());
  // ids[0] succeeds after two progress reports; ids[1..3] are cancelled; ids[4] stays queued.
  ASSERT_TRUE(jobs_->StartAttempt(ids[0], Ranks(1)).ok());
  rackrun::v1::StepProgress p;
  for (int64_t step : {1, 2}) {
    clock_.Advance(1000);
    p.set_step(step);
    ASSERT_TRUE(jobs_->Progress(ids[0], 1, p).ok());
  }
  ASSERT_TRUE(jobs_->RankResult(ids[0], 1, 0, Result(AttemptResult::SUCCEEDED, 2)).ok());
  for (int i = 1; i <= 3; ++i) {
    clock_.Advance(10);
    ASSERT_TRUE(jobs_->Cancel(ids[i], "enough").ok());
  }
  const rackrun::v1::Job first = *jobs_->Get(ids[0]);
  const std::vector<JobEvent> first_events = Events(ids[0]);
  ASSERT_EQ(first.state(), rackrun::v1::SUCCEEDED);
  EXPECT_EQ(jobs_->JobsInMemory(), 5);
  jobs_->ForgetEnded();
  EXPECT_EQ(jobs_->JobsInMemory(), 3);  // ids[2], ids[3] (the last to end) and ids[4]

  // Read back as it was.
  absl::StatusOr<rackrun::v1::Job> again = jobs_->Get(ids[0]);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->DebugString(), first.DebugString());
  const std::vector<JobEvent> events = Events(ids[0]);
  ASSERT_EQ(events.size(), first_events.size());
  for (size_t i = 0; i < events.size(); ++i)
    EXPECT_EQ(events[i].DebugString(), first_events[i].DebugString());
  jobs_->ForgetEnded();
  EXPECT_EQ(jobs_->Cancel(ids[1], "again").status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<Jobs::Ended> late =
      jobs_->RankResult(ids[0], 1, 0, Result(AttemptResult::FAILED, 2));
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(late->job.state(), rackrun::v1::SUCCEEDED);
  EXPECT_EQ(jobs_->Submit(Spec(1), "r1")->job.id(), ids[1]);
  EXPECT_EQ(jobs_->Get("j-99").status().code(), absl::StatusCode::kNotFound);
  jobs_->ForgetEnded();
  EXPECT_EQ(jobs_->JobsInMemory(), 3);

  // List: every job, newest first, pages across forgotten ones, the state filter.
  const auto list = [&](rackrun::v1::JobState state, int page, const std::string& token) {
    rackrun::v1::ListJobsRequest req;
    req.set_state(state);
    req.set_page_size(page);
    req.set_page_token(token);
    absl::StatusOr<rackrun::v1::ListJobsResponse> r = jobs_->List(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.value_or(rackrun::v1::ListJobsResponse());
  };
  const rackrun::v1::ListJobsResponse all = list(rackrun::v1::JOB_STATE_UNSPECIFIED, 10, "");
  ASSERT_EQ(all.jobs_size(), 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(all.jobs(i).id(), ids[4 - i]);
  EXPECT_EQ(all.jobs(4).state(), rackrun::v1::SUCCEEDED);
  EXPECT_EQ(all.jobs(4).last_progress().step(), 2);
  EXPECT_TRUE(all.next_page_token().empty());
  const rackrun::v1::ListJobsResponse page1 = list(rackrun::v1::CANCELLED, 2, "");
  ASSERT_EQ(page1.jobs_size(), 2);
  EXPECT_EQ(page1.jobs(0).id(), ids[3]);
  EXPECT_EQ(page1.jobs(1).id(), ids[2]);
  const rackrun::v1::ListJobsResponse page2 =
      list(rackrun::v1::CANCELLED, 2, page1.next_page_token());
  ASSERT_EQ(page2.jobs_size(), 1);
  EXPECT_EQ(page2.jobs(0).id(), ids[1]);
  EXPECT_TRUE(page2.next_page_token().empty());

  // A restart loads the live job and the two that ended last; the others are read back.
  absl::StatusOr<std::vector<StoredJob>> stored = store_->LoadAll(o.max_ended_in_memory);
  ASSERT_TRUE(stored.ok());
  ASSERT_EQ(stored->size(), 3u);
  jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), o);
  ASSERT_TRUE(jobs_->Initialize(*std::move(stored)).ok());
  EXPECT_EQ(jobs_->JobsInMemory(), 3);
  EXPECT_EQ(jobs_->Get(ids[0])->DebugString(), first.DebugString());

  // A watcher of the queued job: it ends and is forgotten (a bound of none) while it waits.
  o.max_ended_in_memory = 0;
  jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), o);
  ASSERT_TRUE(jobs_->Initialize(*store_->LoadAll(0)).ok());
  EXPECT_EQ(jobs_->JobsInMemory(), 1);
  std::vector<JobEvent> seen;
  bool done = false;
  const int64_t after = static_cast<int64_t>(Events(ids[4]).size());
  std::thread watcher(
      [&] { EXPECT_TRUE(jobs_->WaitEvents(ids[4], after, absl::Seconds(30), &seen, &done).ok()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(jobs_->Cancel(ids[4], "late").ok());
  jobs_->ForgetEnded();
  watcher.join();
  EXPECT_TRUE(done);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back().state(), rackrun::v1::CANCELLED);
}

TEST_F(JobsTest, RestartAfterACoordinatorRestartStartsAtTheLastCheckpoint) {
  const std::string id = jobs_->Submit(Spec(1, 3), "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(1)).ok());
  rackrun::v1::StepProgress p;
  for (int64_t step : {1, 2, 3, 4}) {
    p.set_step(step);
    ASSERT_TRUE(jobs_->Progress(id, 1, p).ok());
    if (step % 2 == 0) {
      ASSERT_TRUE(jobs_->Checkpoint(id, 1, absl::StrCat("/ckpt/step-", step)).ok());
    }
  }
  p.set_step(5);
  ASSERT_TRUE(jobs_->Progress(id, 1, p).ok());  // past the checkpoint: not where it resumes
  // The coordinator restarts: a new Jobs from the same store; the rank never re-attaches.
  auto all = store_->LoadAll();
  ASSERT_TRUE(all.ok());
  jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), Jobs::Options{5000});
  ASSERT_TRUE(jobs_->Initialize(*std::move(all)).ok());
  clock_.Advance(5001);
  std::vector<Jobs::Ended> ended = jobs_->ExpireReattach();
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].job.state(), rackrun::v1::QUEUED);  // restarted by the policy
  auto a2 = jobs_->StartAttempt(id, Ranks(1));
  ASSERT_TRUE(a2.ok()) << a2.status();
  EXPECT_EQ(a2->number(), 2);
  EXPECT_EQ(a2->start_step(), 4);
  // A second restart with no checkpoint in between still resumes there.
  auto all2 = store_->LoadAll();
  ASSERT_TRUE(all2.ok());
  jobs_ = std::make_unique<Jobs>(store_.get(), clock_.clock(), Jobs::Options{5000});
  ASSERT_TRUE(jobs_->Initialize(*std::move(all2)).ok());
  ASSERT_TRUE(jobs_->FailAttempt(id, 2, Lost(0)).ok());
  auto a3 = jobs_->StartAttempt(id, Ranks(1));
  ASSERT_TRUE(a3.ok()) << a3.status();
  EXPECT_EQ(a3->start_step(), 4);
  Events(id);
}

TEST_F(JobsTest, CancelQueuedAndRunning) {
  const std::string q = jobs_->Submit(Spec(1), "q")->job.id();
  auto c = jobs_->Cancel(q, "no longer needed");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->job.state(), rackrun::v1::CANCELLED);
  EXPECT_TRUE(c->to_cancel.empty());
  const std::string r = jobs_->Submit(Spec(2), "r")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(r, Ranks(2)).ok());
  auto c2 = jobs_->Cancel(r, "");
  ASSERT_TRUE(c2.ok());
  EXPECT_EQ(c2->to_cancel.size(), 2u);
  EXPECT_EQ(c2->job.attempts(0).state(), rackrun::v1::CANCELLED);
  // The ranks' CANCELLED results after a cancel change nothing.
  auto late = jobs_->RankResult(r, 1, 0, Result(AttemptResult::CANCELLED));
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->job.state(), rackrun::v1::CANCELLED);
  EXPECT_FALSE(late->job.has_first_failure());
}

TEST_F(JobsTest, ListNewestFirstPaged) {
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(jobs_->Submit(Spec(1), absl::StrCat("r", i)).ok());
  ASSERT_TRUE(jobs_->Cancel("j-2", "").ok());
  rackrun::v1::ListJobsRequest req;
  req.set_page_size(2);
  auto p1 = jobs_->List(req);
  ASSERT_TRUE(p1.ok());
  ASSERT_EQ(p1->jobs_size(), 2);
  EXPECT_EQ(p1->jobs(0).id(), "j-5");
  EXPECT_FALSE(p1->jobs(0).has_spec());
  req.set_page_token(p1->next_page_token());
  auto p2 = jobs_->List(req);
  EXPECT_EQ(p2->jobs(0).id(), "j-3");
  req.set_page_token(p2->next_page_token());
  auto p3 = jobs_->List(req);
  ASSERT_EQ(p3->jobs_size(), 1);
  EXPECT_EQ(p3->jobs(0).id(), "j-1");
  EXPECT_TRUE(p3->next_page_token().empty());
  rackrun::v1::ListJobsRequest cancelled;
  cancelled.set_state(rackrun::v1::CANCELLED);
  EXPECT_EQ(jobs_->List(cancelled)->jobs_size(), 1);
  req.set_page_token("zz");
  EXPECT_EQ(jobs_->List(req).status().code(), absl::StatusCode::kInvalidArgument);
}

// List leaves the last progress's bulky detail (per-domain figures, the per-expert sample)
// to Get; a job without progress gets none.
TEST_F(JobsTest, ListLeavesPerDomainAndPerExpertDetailToGet) {
  const std::string id = jobs_->Submit(Spec(2), "r")->job.id();
  const std::string queued = jobs_->Submit(Spec(1), "q")->job.id();
  ASSERT_TRUE(jobs_->StartAttempt(id, Ranks(2)).ok());
  rackrun::v1::StepProgress p;
  p.set_step(3);
  p.add_imbalance_before(1.5);
  p.add_domains()->add_imbalance_before(1.5);
  p.add_domains()->add_imbalance_before(1.7);
  p.add_expert_loads()->add_tokens(12);
  ASSERT_TRUE(jobs_->Progress(id, 1, p).ok());
  auto list = jobs_->List(rackrun::v1::ListJobsRequest());
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->jobs_size(), 2);
  EXPECT_EQ(list->jobs(0).id(), queued);
  EXPECT_FALSE(list->jobs(0).has_last_progress());
  const rackrun::v1::StepProgress& listed = list->jobs(1).last_progress();
  EXPECT_EQ(listed.step(), 3);
  EXPECT_EQ(listed.imbalance_before_size(), 1);
  EXPECT_EQ(listed.domains_size(), 0);
  EXPECT_EQ(listed.expert_loads_size(), 0);
  auto got = jobs_->Get(id);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->last_progress().domains_size(), 2);
  EXPECT_EQ(got->last_progress().expert_loads_size(), 1);
}

}  // namespace
}  // namespace rackrun::coordinator
