#include "rpc/rack_label.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::rpc {
namespace {

using ::testing::HasSubstr;

TEST(RackLabelTest, AcceptsNamesAndRefusesOthersSayingWhatIsAllowed) {
  for (const char* ok : {"", "a", "rack-a", "row3.rack_12", "R1"}) {
    EXPECT_TRUE(CheckRackLabel(ok).ok()) << ok;
  }
  EXPECT_TRUE(CheckRackLabel(std::string(kMaxRackLabelLength, 'x')).ok());
  const absl::Status spaced = CheckRackLabel("rack a");
  EXPECT_EQ(spaced.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      std::string(spaced.message()),
      "the rack label 'rack a' may hold only letters, digits, '.', '_' and '-' (e.g. rack-a)");
  EXPECT_FALSE(CheckRackLabel("a/b").ok());
  EXPECT_THAT(std::string(CheckRackLabel(std::string(64, 'x')).message()),
              HasSubstr("the rack label is 64 characters long; use at most 63"));
}

}  // namespace
}  // namespace rackrun::rpc
