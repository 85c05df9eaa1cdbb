// The in-memory rendezvous store: values, waiting for keys set by other threads, and the
// timeout naming exactly the missing keys.
#include "comm/rendezvous_store.h"

#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(InMemoryRendezvousStore, GetReturnsValuesInKeyOrder) {
  InMemoryRendezvousStore store;
  ASSERT_TRUE(store.Set("a", "1").ok());
  ASSERT_TRUE(store.Set("b", std::string("\0x", 2)).ok());
  absl::StatusOr<std::vector<std::string>> values = store.Get({"b", "a"}, absl::ZeroDuration());
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre(std::string("\0x", 2), "1"));
  ASSERT_TRUE(store.Set("a", "2").ok());
  EXPECT_THAT(*store.Get({"a"}, absl::ZeroDuration()), ElementsAre("2"));
  EXPECT_TRUE(store.Get({}, absl::ZeroDuration()).ok());
}

TEST(InMemoryRendezvousStore, GetWaitsForKeysSetByOtherThreads) {
  InMemoryRendezvousStore store;
  std::vector<std::thread> setters;
  for (int i = 0; i < 4; ++i) {
    setters.emplace_back([&store, i] {
      std::this_thread::sleep_for(std::chrono::milliseconds(10 * i));
      EXPECT_TRUE(store.Set("rank/" + std::to_string(i), std::to_string(i * i)).ok());
    });
  }
  absl::StatusOr<std::vector<std::string>> values =
      store.Get({"rank/0", "rank/1", "rank/2", "rank/3"}, absl::Seconds(30));
  for (std::thread& t : setters) t.join();
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre("0", "1", "4", "9"));
}

TEST(InMemoryRendezvousStore, TimeoutNamesOnlyTheMissingKeys) {
  InMemoryRendezvousStore store;
  ASSERT_TRUE(store.Set("job/1/here", "").ok());
  absl::StatusOr<std::vector<std::string>> values =
      store.Get({"job/1/here", "job/1/late", "job/1/gone"}, absl::Milliseconds(20));
  ASSERT_FALSE(values.ok());
  EXPECT_EQ(values.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(values.status().message(), HasSubstr("'job/1/late', 'job/1/gone'"));
  EXPECT_THAT(values.status().message(), Not(HasSubstr("here")));
  // A zero timeout checks once.
  EXPECT_EQ(store.Get({"job/1/late"}, absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace rackrun::comm
