#include "coordinator/rendezvous.h"

#include <gtest/gtest.h>

#include <thread>

namespace rackrun::coordinator {
namespace {

TEST(RendezvousTest, GetWaitsForEveryKey) {
  Rendezvous rv;
  rv.Set("j-1", 1, "a", "1");
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    rv.Set("j-1", 1, "b", "2");
  });
  auto v = rv.Get("j-1", 1, {"a", "b"}, absl::Now() + absl::Seconds(10));
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, (std::vector<std::string>{"1", "2"}));
}

TEST(RendezvousTest, DeadlineNamesTheMissingKeysAndAttemptsAreSeparate) {
  Rendezvous rv;
  rv.Set("j-1", 1, "a", "1");
  rv.Set("j-1", 2, "b", "x");
  auto v = rv.Get("j-1", 1, {"a", "b", "c"}, absl::Now() + absl::Milliseconds(30));
  ASSERT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(v.status().message().find("b, c"), std::string::npos) << v.status();
}

TEST(RendezvousTest, DropForgetsAndWakes) {
  Rendezvous rv;
  rv.Set("j-1", 1, "a", "1");
  std::thread dropper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    rv.Drop("j-1", 1);
  });
  auto v = rv.Get("j-1", 1, {"a", "never"}, absl::Now() + absl::Seconds(10));
  dropper.join();
  EXPECT_EQ(v.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(rv.Get("j-1", 1, {"a"}, absl::Now()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace rackrun::coordinator
