#include "base/crc32c.h"

#include "gtest/gtest.h"

namespace rackrun::base {
namespace {

TEST(Crc32cTest, KnownVectorsAndContinuation) {
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c("123456789"), 0xe3069283u);  // the standard check value
  EXPECT_EQ(Crc32c("56789", Crc32c("1234")), Crc32c("123456789"));
}

}  // namespace
}  // namespace rackrun::base
