#include "rpc/rack_label.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::rpc {
namespace {

using ::testing::HasSubstr;

TEST(RackLabelTest, AcceptsNamesAndRefusesOthersNamingTheField) {
  for (const char* ok : {"", "a", "rack-a", "row3.rack_12", "R1"}) {
    EXPECT_TRUE(CheckRackLabel(ok, "--rack").ok()) << ok;
  }
  EXPECT_TRUE(CheckRackLabel(std::string(kMaxRackLabelLength, 'x'), "rack").ok());
  const absl::Status spaced = CheckRackLabel("rack a", "--rack");
  EXPECT_EQ(spaced.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spaced.message()),
              HasSubstr("--rack: the rack label 'rack a' may hold only letters, digits"));
  EXPECT_THAT(std::string(CheckRackLabel("a/b", "rack").message()), HasSubstr("rack: "));
  EXPECT_THAT(std::string(CheckRackLabel(std::string(64, 'x'), "rack").message()),
              HasSubstr("rack: the rack label is 64 characters long; use at most 63"));
}

}  // namespace
}  // namespace rackrun::rpc
