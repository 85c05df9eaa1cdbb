// The channels a job chooses by name (channel_names.h) and CreateChannel: the list's
// lookups and the choices a spec error gives, every CPU channel of the list built by name
// on 2 ranks (its backend is the one named, its AllReduce sums like the in-process
// channel's, its label reaches the backend), the default for an empty name, and the errors
// for an unknown name and a channel this build lacks.
#include "comm/channel_factory.h"

#include <set>
#include <string>

#include "base/string_view.h"
#include "comm/testing/channel_checks.h"
#include "comm/testing/store_channel_checks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

using ::testing::HasSubstr;

// A factory for the store-channel checks: the channel named `name` on loopback.
testing::StoreChannelFactory Named(std::string name) {
  return [name](RendezvousStore& store, const std::string& prefix, int rank, int size,
                absl::Duration timeout) {
    ChannelSetup setup;
    setup.prefix = prefix;
    setup.rank = rank;
    setup.size = size;
    setup.channel.timeout = timeout;
    setup.address = "127.0.0.1";
    setup.label = "rank " + std::to_string(rank) + " of the factory test";
    return CreateChannel(name, store, setup);
  };
}

TEST(ChannelNamesTest, TheListFindsEveryNameOnce) {
  std::set<std::string_view> names;
  for (const ChannelTraits& c : kChannels) {
    EXPECT_TRUE(names.insert(c.name).second) << c.name << " is listed twice";
    EXPECT_EQ(FindChannel(c.name), &c);
  }
  EXPECT_EQ(FindChannel(""), nullptr);
  EXPECT_EQ(FindChannel("mpi"), nullptr);  // the direct launch's, not chosen by name
  EXPECT_EQ(kDefaultChannel, "ucx");
  EXPECT_EQ(ChannelOrDefault(""), "ucx");
  EXPECT_EQ(ChannelOrDefault("gloo"), "gloo");
  EXPECT_EQ(ChannelChoices(), "ucx (CPU, the default), gloo (CPU) or nccl (GPU)");
  const ChannelTraits* nccl = FindChannel("nccl");
  ASSERT_NE(nccl, nullptr);
  EXPECT_TRUE(nccl->needs_gpu);
  EXPECT_TRUE(ChannelBuilt(ChannelKind::kUcx));
  EXPECT_TRUE(ChannelBuilt(ChannelKind::kGloo));
}

// Every CPU channel of the list, by its name: the backend named, collectives that work.
TEST(CreateChannelTest, BuildsEveryCpuChannelByName) {
  for (const ChannelTraits& c : kChannels) {
    if (c.needs_gpu) continue;
    SCOPED_TRACE(std::string(c.name));
    testing::CheckOnRanks(Named(std::string(c.name)), 2, base::AsAbsl(c.name),
                          [](DataChannel& channel) {
                            testing::CheckAllReduce(channel, /*fixed_order=*/true);
                            testing::CheckSendRecv(channel);
                          });
    testing::CheckAllReduceEqualsInProcessBitForBit(Named(std::string(c.name)));
  }
}

TEST(CreateChannelTest, AnEmptyNameIsTheDefaultChannel) {
  testing::CheckOnRanks(Named(""), 2, "ucx", testing::CheckBarrier);
}

TEST(CreateChannelTest, RefusesAnUnknownNameListingTheChoices) {
  InMemoryRendezvousStore store;
  ChannelSetup setup;
  absl::StatusOr<std::unique_ptr<DataChannel>> c = CreateChannel("tcp", store, setup);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("resources.channel: unknown data channel 'tcp'; choose ucx (CPU, the "
                        "default), gloo (CPU) or nccl (GPU)"));
}

// A channel of the list that this build lacks is refused naming who lacks it (a build
// without CUDA or NCCL; with them, the NCCL channel's own test runs it on a GPU).
TEST(CreateChannelTest, AChannelThisBuildLacksIsRefusedNamingTheProcess) {
  for (const ChannelTraits& c : kChannels) {
    if (ChannelBuilt(c.kind)) continue;
    InMemoryRendezvousStore store;
    ChannelSetup setup;
    setup.label = "worker w-1 on host h1";
    absl::StatusOr<std::unique_ptr<DataChannel>> made = CreateChannel(c.name, store, setup);
    ASSERT_FALSE(made.ok());
    EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(made.status().message()),
                HasSubstr("worker w-1 on host h1 was built without the " + std::string(c.name)));
    return;
  }
  GTEST_SKIP() << "this build has every channel of the list (CUDA and NCCL were found)";
}

}  // namespace
}  // namespace rackrun::comm
