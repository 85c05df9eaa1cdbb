// CompletionEvent and ProgressBackoff: a blocked waiter wakes on Notify, a completion
// between reading the generation and blocking is not missed, and a wait ends by its deadline.
#include "comm/progress.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

using std::chrono::steady_clock;

TEST(CompletionEventTest, NotifyWakesABlockedWaiter) {
  CompletionEvent event;
  const uint64_t seen = event.generation();
  std::atomic<bool> woke{false};
  std::thread waiter([&] {
    event.WaitPast(seen, steady_clock::now() + std::chrono::seconds(30));
    woke = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(woke.load());  // still blocked: nothing completed
  const absl::Time notified = absl::Now();
  event.Notify();
  waiter.join();
  EXPECT_TRUE(woke.load());
  EXPECT_LT(absl::Now() - notified, absl::Seconds(10));  // woken, not timed out
  EXPECT_EQ(event.generation(), seen + 1);
}

TEST(CompletionEventTest, ACompletionBeforeTheWaitIsNotMissed) {
  CompletionEvent event;
  const uint64_t seen = event.generation();
  event.Notify();  // completes after the read, before the wait
  const absl::Time start = absl::Now();
  event.WaitPast(seen, steady_clock::now() + std::chrono::seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(CompletionEventTest, WaitEndsAtItsDeadlineWithoutANotify) {
  CompletionEvent event;
  const absl::Time start = absl::Now();
  event.WaitPast(event.generation(), steady_clock::now() + std::chrono::milliseconds(30));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(29));
}

TEST(ProgressBackoffTest, IdleBlocksOnTheEventUntilANotify) {
  CompletionEvent event;
  ProgressBackoff backoff(&event);
  backoff.StartPass();
  std::thread notifier([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    event.Notify();
  });
  const absl::Time start = absl::Now();
  backoff.Idle(absl::Now() + absl::Seconds(30));
  const absl::Duration waited = absl::Now() - start;
  notifier.join();
  EXPECT_GE(waited, absl::Milliseconds(15));  // it blocked rather than returning at once
  EXPECT_LT(waited, absl::Seconds(10));
}

TEST(ProgressBackoffTest, IdleReturnsByTheCallersDeadline) {
  CompletionEvent event;
  ProgressBackoff backoff(&event);
  backoff.StartPass();
  const absl::Time deadline = absl::Now() + absl::Milliseconds(10);
  backoff.Idle(deadline);
  EXPECT_GE(absl::Now(), deadline - absl::Milliseconds(1));
  // Past the deadline it does not block at all.
  const absl::Time start = absl::Now();
  backoff.StartPass();
  backoff.Idle(deadline);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(ProgressBackoffTest, WithoutAnEventIdleReturnsAtOnce) {
  ProgressBackoff backoff;
  const absl::Time start = absl::Now();
  for (int i = 0; i < 100; ++i) {
    backoff.StartPass();
    backoff.Idle(absl::Now() + absl::Seconds(30));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

}  // namespace
}  // namespace rackrun::comm
