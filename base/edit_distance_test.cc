#include "base/edit_distance.h"

#include "gtest/gtest.h"

namespace rackrun::base {
namespace {

TEST(EditDistanceTest, CountsInsertionsDeletionsAndSubstitutions) {
  EXPECT_EQ(EditDistance("", ""), 0u);
  EXPECT_EQ(EditDistance("", "abc"), 3u);
  EXPECT_EQ(EditDistance("abc", ""), 3u);
  EXPECT_EQ(EditDistance("--threads", "--threads"), 0u);
  EXPECT_EQ(EditDistance("--thread", "--threads"), 1u);    // insertion
  EXPECT_EQ(EditDistance("--threadss", "--threads"), 1u);  // deletion
  EXPECT_EQ(EditDistance("--thraeds", "--threads"), 2u);   // two substitutions
  EXPECT_EQ(EditDistance("kitten", "sitting"), 3u);
  EXPECT_EQ(EditDistance("sitting", "kitten"), 3u);
}

}  // namespace
}  // namespace rackrun::base
