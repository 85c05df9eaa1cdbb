#include "rpc/phase.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace rackrun::rpc {
namespace {

TEST(PhaseTest, EveryPhaseRoundTripsThroughItsName) {
  std::set<std::string> names;
  for (int i = static_cast<int>(Phase::kIdle); i < static_cast<int>(Phase::kOther); ++i) {
    const Phase p = static_cast<Phase>(i);
    EXPECT_EQ(ParsePhase(PhaseName(p)), p) << PhaseName(p);
    EXPECT_TRUE(names.insert(PhaseName(p)).second) << "two phases named " << PhaseName(p);
  }
}

TEST(PhaseTest, TheWireNamesAreTheDocumentedOnes) {
  EXPECT_STREQ(PhaseName(Phase::kIdle), "idle");
  EXPECT_STREQ(PhaseName(Phase::kStarting), "starting");
  EXPECT_STREQ(PhaseName(Phase::kConnecting), "connecting");
  EXPECT_STREQ(PhaseName(Phase::kForwardBackward), "forward_backward");
  EXPECT_STREQ(PhaseName(Phase::kCollective), "collective");
  EXPECT_STREQ(PhaseName(Phase::kReporting), "reporting");
}

TEST(PhaseTest, EmptyIsIdleAndUnknownNamesAreOther) {
  EXPECT_EQ(ParsePhase(""), Phase::kIdle);
  EXPECT_EQ(ParsePhase("forward"), Phase::kOther);
  EXPECT_EQ(ParsePhase("Starting"), Phase::kOther);
  EXPECT_EQ(ParsePhase("other"), Phase::kOther);
}

}  // namespace
}  // namespace rackrun::rpc
