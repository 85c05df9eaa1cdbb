// Where the launcher put a worker (launcher_watch.h: LauncherPlaceOf): rank, size and local
// rank from one launcher's variables, and the start-up line's words for it. Issue 37's log
// showed "launcher rank 0 of 0" for a worker started by hand with a torchrun-style RANK and
// no WORLD_SIZE.
#include <map>
#include <string>

#include "gtest/gtest.h"
#include "worker/launcher_watch.h"

namespace rackrun::worker {
namespace {

LauncherPlace PlaceIn(const std::map<std::string, std::string>& env) {
  return LauncherPlaceOf([&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(LauncherPlaceTest, OpenMpisRankSizeAndLocalRank) {
  // What mpirun -np 4 sets (PMIx's rank too).
  const LauncherPlace p = PlaceIn({{"OMPI_COMM_WORLD_RANK", "3"},
                                   {"OMPI_COMM_WORLD_SIZE", "4"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                   {"PMIX_RANK", "3"}});
  EXPECT_EQ(p.rank, 3);
  EXPECT_EQ(p.size, 4);
  EXPECT_EQ(p.local_rank, 1);
  EXPECT_EQ(DescribeLauncherPlace(p), "launcher rank 3 of 4 (OMPI_COMM_WORLD_RANK)");
}

TEST(LauncherPlaceTest, SlurmsStepSizeWhenNtasksIsMissing) {
  const LauncherPlace p =
      PlaceIn({{"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_LOCALID", "1"}});
  EXPECT_EQ(p.rank, 1);
  EXPECT_EQ(p.size, 2);
  EXPECT_EQ(p.local_rank, 1);
  EXPECT_EQ(DescribeLauncherPlace(p), "launcher rank 1 of 2 (SLURM_PROCID)");
  EXPECT_EQ(
      PlaceIn({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "8"}, {"SLURM_STEP_NUM_TASKS", "2"}}).size,
      8);
}

// A rank never takes another launcher's size: RANK with a stray SLURM_NTASKS is a rank
// without a size, said so instead of "of 0" (or "of 16").
TEST(LauncherPlaceTest, ARankWithoutItsLaunchersSizeSaysSo) {
  const LauncherPlace p = PlaceIn({{"RANK", "0"}, {"SLURM_NTASKS", "16"}});
  EXPECT_EQ(p.rank, 0);
  EXPECT_EQ(p.size, 0);
  EXPECT_EQ(DescribeLauncherPlace(p), "launcher rank 0 (RANK; WORLD_SIZE not set)");
  EXPECT_EQ(DescribeLauncherPlace(PlaceIn({{"RANK", "1"}, {"WORLD_SIZE", "2"}})),
            "launcher rank 1 of 2 (RANK)");
  EXPECT_EQ(DescribeLauncherPlace(PlaceIn({{"PMIX_RANK", "5"}})),
            "launcher rank 5 (PMIX_RANK; no size in the environment)");
}

TEST(LauncherPlaceTest, NoLauncherAndMalformedValues) {
  const LauncherPlace none = PlaceIn({});
  EXPECT_EQ(none.rank, -1);
  EXPECT_EQ(none.size, 0);
  EXPECT_EQ(DescribeLauncherPlace(none), "no launcher rank (started by hand)");
  // A rank that is not a number is no rank: the next launcher's is read.
  const LauncherPlace p =
      PlaceIn({{"OMPI_COMM_WORLD_RANK", "x"}, {"RANK", "2"}, {"WORLD_SIZE", "-3"}});
  EXPECT_EQ(p.rank, 2);
  EXPECT_EQ(p.size, 0);
  EXPECT_STREQ(p.rank_variable, "RANK");
}

}  // namespace
}  // namespace rackrun::worker
