// RaiseOpenFileLimit: the soft limit rises to the hard one (or the cap), never falls.
#include "base/process_limits.h"

#include <sys/resource.h>

#include <algorithm>

#include "gtest/gtest.h"

namespace rackrun::base {
namespace {

TEST(ProcessLimitsTest, TheSoftOpenFileLimitRisesToTheHardOne) {
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  if (before.rlim_max != RLIM_INFINITY && before.rlim_max < 512) {
    GTEST_SKIP() << "the hard limit (" << before.rlim_max << ") leaves no room to lower and raise";
  }
  rlimit low = before;
  low.rlim_cur = 256;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  // Capped below the hard limit.
  absl::StatusOr<int64_t> got = RaiseOpenFileLimit(400);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 400);
  rlimit now{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &now), 0);
  EXPECT_EQ(now.rlim_cur, 400u);
  EXPECT_EQ(now.rlim_max, before.rlim_max) << "the hard limit is left alone";
  // Up to the hard limit (or the default cap).
  got = RaiseOpenFileLimit();
  ASSERT_TRUE(got.ok()) << got.status();
  const int64_t want =
      before.rlim_max == RLIM_INFINITY
          ? int64_t{1} << 20
          : std::min<int64_t>(static_cast<int64_t>(before.rlim_max), int64_t{1} << 20);
  EXPECT_EQ(*got, want);
  // Never lowered: a cap below the soft limit leaves it.
  got = RaiseOpenFileLimit(300);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, want);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
}

}  // namespace
}  // namespace rackrun::base
