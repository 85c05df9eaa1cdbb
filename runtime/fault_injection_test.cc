// FaultInjection: the RACKRUN_FAULT form, its errors, when a fault is due, and the
// process's fault (set at start from the environment, or for a test's scope).
#include "runtime/fault_injection.h"

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::runtime {
namespace {

using ::testing::HasSubstr;

TEST(FaultInjectionTest, ParsesEveryKindWithKeysInAnyOrder) {
  absl::StatusOr<FaultInjection> f = FaultInjection::Parse("stall:microbatch=3,rank=2,layer=1");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kind(), FaultKind::kStall);
  EXPECT_EQ(f->rank(), 2);
  EXPECT_EQ(f->layer(), 1);
  EXPECT_EQ(f->microbatch(), 3);
  EXPECT_EQ(FaultInjection::Parse("plan_hash:rank=0,layer=0,microbatch=0")->kind(),
            FaultKind::kPlanHash);
  EXPECT_EQ(FaultInjection::Parse("exit:rank=1,layer=2,microbatch=5")->kind(), FaultKind::kExit);
}

TEST(FaultInjectionTest, DueOnlyAtItsKindRankLayerAndMicrobatch) {
  const FaultInjection f = *FaultInjection::Parse("exit:rank=1,layer=2,microbatch=5");
  EXPECT_TRUE(f.Due(FaultKind::kExit, 1, 2, 5));
  EXPECT_FALSE(f.Due(FaultKind::kStall, 1, 2, 5));
  EXPECT_FALSE(f.Due(FaultKind::kExit, 0, 2, 5));
  EXPECT_FALSE(f.Due(FaultKind::kExit, 1, 1, 5));
  EXPECT_FALSE(f.Due(FaultKind::kExit, 1, 2, 4));
}

TEST(FaultInjectionTest, MalformedValuesNameTheVariableAndTheForm) {
  for (const char* value :
       {"", "plan_hash", "plan_hash:rank=1,layer=0", "crash:rank=1,layer=0,microbatch=1",
        "stall:rank=1,layer=0,microbatch=x", "stall:rank=1,layer=0,microbatch=1,step=2",
        "stall:rank=1,rank=2,layer=0", "exit:rank=-1,layer=0,microbatch=0"}) {
    absl::StatusOr<FaultInjection> f = FaultInjection::Parse(value);
    ASSERT_FALSE(f.ok()) << value;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(f.status().message()),
                HasSubstr(std::string("RACKRUN_FAULT='") + value + "'"));
    EXPECT_THAT(std::string(f.status().message()), HasSubstr("KIND:rank=R,layer=L,microbatch=M"));
  }
}

TEST(FaultInjectionTest, FromEnvironmentReadsRackrunFault) {
  ::unsetenv("RACKRUN_FAULT");
  absl::StatusOr<std::optional<FaultInjection>> none = FaultInjection::FromEnvironment();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  ::setenv("RACKRUN_FAULT", "stall:rank=1,layer=0,microbatch=2", 1);
  absl::StatusOr<std::optional<FaultInjection>> some = FaultInjection::FromEnvironment();
  ASSERT_TRUE(some.ok() && some->has_value());
  EXPECT_TRUE((*some)->Due(FaultKind::kStall, 1, 0, 2));
  ::setenv("RACKRUN_FAULT", "stall", 1);
  EXPECT_FALSE(FaultInjection::FromEnvironment().ok());
  ::unsetenv("RACKRUN_FAULT");
}

TEST(FaultInjectionTest, TheProcessFaultIsSetFromTheEnvironmentOnce) {
  ::unsetenv("RACKRUN_FAULT");
  ASSERT_TRUE(InstallFaultInjectionFromEnvironment().ok());
  EXPECT_FALSE(ProcessFaultInjection().has_value());
  ::setenv("RACKRUN_FAULT", "exit:rank=3,layer=1,microbatch=2", 1);
  ASSERT_TRUE(InstallFaultInjectionFromEnvironment().ok());
  ASSERT_TRUE(ProcessFaultInjection().has_value());
  EXPECT_TRUE(ProcessFaultInjection()->Due(FaultKind::kExit, 3, 1, 2));
  // A malformed value is refused naming the variable, and sets nothing.
  ::setenv("RACKRUN_FAULT", "exit:rank=3", 1);
  const absl::Status bad = InstallFaultInjectionFromEnvironment();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("RACKRUN_FAULT='exit:rank=3' is malformed"));
  EXPECT_TRUE(ProcessFaultInjection()->Due(FaultKind::kExit, 3, 1, 2));
  ::unsetenv("RACKRUN_FAULT");
  SetProcessFaultInjection(std::nullopt);
  EXPECT_FALSE(ProcessFaultInjection().has_value());
}

TEST(FaultInjectionTest, AScopedFaultLastsItsScope) {
  SetProcessFaultInjection(*FaultInjection::Parse("stall:rank=0,layer=0,microbatch=0"));
  {
    const ScopedFaultInjection scoped(
        *FaultInjection::Parse("plan_hash:rank=1,layer=2,microbatch=3"));
    ASSERT_TRUE(ProcessFaultInjection().has_value());
    EXPECT_TRUE(ProcessFaultInjection()->Due(FaultKind::kPlanHash, 1, 2, 3));
    {
      const ScopedFaultInjection none(std::nullopt);
      EXPECT_FALSE(ProcessFaultInjection().has_value());
    }
    EXPECT_TRUE(ProcessFaultInjection()->Due(FaultKind::kPlanHash, 1, 2, 3));
  }
  ASSERT_TRUE(ProcessFaultInjection().has_value());
  EXPECT_TRUE(ProcessFaultInjection()->Due(FaultKind::kStall, 0, 0, 0));
  SetProcessFaultInjection(std::nullopt);
}

}  // namespace
}  // namespace rackrun::runtime
