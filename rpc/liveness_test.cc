// The control plane's timings (rpc/liveness.h): the figures for the defaults and for the
// daemon tests' coordinator, and the invariants the derivation promises for any interval
// and timeout the coordinator accepts.
#include "rpc/liveness.h"

#include <chrono>

#include "gtest/gtest.h"

namespace rackrun::rpc {
namespace {

using std::chrono::milliseconds;

// The coordinator's defaults: heartbeat every 1 s, lost after 5 s.
TEST(LivenessTest, TheDefaultsSurviveACutOfTwoAndThreeQuarterSeconds) {
  const LivenessTimings t = LivenessFor(milliseconds(1000), milliseconds(5000));
  EXPECT_EQ(t.heartbeat_deadline, milliseconds(1250));
  EXPECT_EQ(t.retry_period, milliseconds(1250));
  EXPECT_EQ(t.late_after, milliseconds(2250));
  EXPECT_EQ(t.keepalive_time, milliseconds(10000));
  EXPECT_EQ(t.keepalive_timeout, milliseconds(20000));
  EXPECT_EQ(t.initial_reconnect_backoff, milliseconds(100));
  EXPECT_EQ(t.max_reconnect_backoff, milliseconds(1250));
  EXPECT_EQ(t.survivable_cut, milliseconds(2750));
}

// The daemon tests' coordinator (tests/support/daemon_fixture.h) on a quiet machine:
// heartbeat every 200 ms, lost after 3 s.
TEST(LivenessTest, TheDaemonTestsSurviveACutOfAboutTwoSeconds) {
  const LivenessTimings t = LivenessFor(milliseconds(200), milliseconds(3000));
  EXPECT_EQ(t.heartbeat_deadline, milliseconds(750));
  EXPECT_EQ(t.retry_period, milliseconds(750));
  EXPECT_EQ(t.late_after, milliseconds(950));
  EXPECT_EQ(t.keepalive_timeout, milliseconds(20000));
  EXPECT_EQ(LivenessFor(milliseconds(200), milliseconds(12000)).keepalive_timeout,
            milliseconds(24200));
  EXPECT_EQ(t.initial_reconnect_backoff, milliseconds(100));
  EXPECT_EQ(t.survivable_cut, milliseconds(2050));
}

// A timeout that leaves no room for a missed heartbeat's retry survives no cut.
TEST(LivenessTest, ATimeoutOfTwoIntervalsSurvivesNoCut) {
  EXPECT_EQ(LivenessFor(milliseconds(1000), milliseconds(2000)).survivable_cut, milliseconds(0));
  EXPECT_EQ(LivenessFor(milliseconds(1000), milliseconds(1500)).survivable_cut, milliseconds(0));
}

// For every interval and timeout the coordinator accepts (timeout above the interval):
// - a heartbeat's deadline is below the timeout, and so is the gap after one missed
//   heartbeat (late_after), so a late rank is not yet a silent one;
// - the silence a survivable cut costs (I + B + P) stays within the timeout;
// - the keepalive timeout outlasts the longest retransmission stall of a survivable cut
//   (about 2B + a SYN's first retransmission timeout, 1 s), so no connection is dropped
//   for a cut the heartbeats survive, and gRPC's own default (20 s, several cuts in a row);
// - a reconnecting channel tries at least once per heartbeat deadline.
TEST(LivenessTest, InvariantsHoldForEveryIntervalAndTimeout) {
  for (const int64_t interval : {1, 50, 200, 1000, 5000}) {
    for (const int64_t factor : {2, 3, 5, 10, 60}) {
      for (const int64_t extra : {1, 0}) {
        const milliseconds i(interval), t(interval * factor + extra);
        const LivenessTimings l = LivenessFor(i, t);
        SCOPED_TRACE(testing::Message() << "interval " << interval << " timeout " << t.count());
        EXPECT_LT(l.heartbeat_deadline, t);
        EXPECT_GE(l.heartbeat_deadline, i);
        EXPECT_GE(l.retry_period, l.heartbeat_deadline);
        EXPECT_EQ(l.late_after, i + l.retry_period);
        if (l.survivable_cut > milliseconds(0)) {
          EXPECT_LT(l.late_after, t);
          EXPECT_EQ(i + l.survivable_cut + l.retry_period, t);
        }
        EXPECT_GT(l.keepalive_timeout, 2 * l.survivable_cut + milliseconds(1000));
        EXPECT_GE(l.keepalive_timeout, milliseconds(20000));
        EXPECT_LE(l.max_reconnect_backoff, l.heartbeat_deadline);
        EXPECT_LE(l.initial_reconnect_backoff, l.max_reconnect_backoff);
      }
    }
  }
}

}  // namespace
}  // namespace rackrun::rpc
