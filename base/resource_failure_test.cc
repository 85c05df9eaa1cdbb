// The resource exceptions as Status values: what CatchResourceFailures returns for each,
// that the body's value passes through, and that what the body made is destroyed first.
#include "base/resource_failure.h"

#include <cerrno>
#include <memory>
#include <new>
#include <string>
#include <system_error>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::base {
namespace {

using ::testing::HasSubstr;

TEST(ResourceFailureTest, TheBodysValuePassesThrough) {
  absl::StatusOr<int> v = CatchResourceFailures([] { return 42; });
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 42);
}

TEST(ResourceFailureTest, AFailedAllocationIsOutOfMemory) {
  bool destroyed = false;
  absl::StatusOr<int> v = CatchResourceFailures([&] {
    const std::shared_ptr<void> made(nullptr, [&](void*) { destroyed = true; });
    throw std::bad_alloc();
    return 1;
  });
  ASSERT_FALSE(v.ok());
  EXPECT_TRUE(destroyed);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(v.status().message()),
              HasSubstr("out of memory: an allocation failed although the job's memory "
                        "estimate fit"));
}

TEST(ResourceFailureTest, AThreadThatCannotStartIsNamedAndOtherSystemErrorsToo) {
  absl::StatusOr<int> v = CatchResourceFailures([]() -> int {
    throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                            "thread");
  });
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("could not start a thread (thread"));
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("ulimit -u"));

  v = CatchResourceFailures([]() -> int {
    throw std::system_error(std::make_error_code(std::errc::bad_file_descriptor), "close");
  });
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("a system call failed: close"));
}

}  // namespace
}  // namespace rackrun::base
