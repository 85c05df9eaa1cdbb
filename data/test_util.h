// What data/'s tests share: a scratch folder per test and the committed Brown sample.
#ifndef RACKRUN_DATA_TEST_UTIL_H_
#define RACKRUN_DATA_TEST_UTIL_H_

#include <filesystem>
#include <string>

#include "gtest/gtest.h"

namespace rackrun::data::testing {

// An empty folder of the running test's own (removed and made anew).
inline std::filesystem::path TestDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    (std::string("data_") + info->test_suite_name()) / info->name();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::string BrownSample() {
  return std::string(RACKRUN_SOURCE_DIR) + "/tests/data/brown-sample.txt";
}

}  // namespace rackrun::data::testing

#endif  // RACKRUN_DATA_TEST_UTIL_H_
