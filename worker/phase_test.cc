// The trainer's phases reach the heartbeat under runtime::TrainPhaseName's names: the
// worker's mapping onto rpc::Phase and the two name lists agree.
#include "rpc/phase.h"

#include <gtest/gtest.h>

#include <string>

#include "runtime/trainer.h"
#include "worker/job_runner.h"

namespace rackrun::worker {
namespace {

TEST(WorkerPhaseTest, EveryTrainPhaseKeepsItsName) {
  for (int i = static_cast<int>(runtime::TrainPhase::kIdle);
       i <= static_cast<int>(runtime::TrainPhase::kCheckpoint); ++i) {
    const auto p = static_cast<runtime::TrainPhase>(i);
    EXPECT_NE(WorkerPhase(p), rpc::Phase::kOther) << runtime::TrainPhaseName(p);
    EXPECT_EQ(std::string(rpc::PhaseName(WorkerPhase(p))), runtime::TrainPhaseName(p));
    EXPECT_EQ(rpc::ParsePhase(runtime::TrainPhaseName(p)), WorkerPhase(p));
  }
}

}  // namespace
}  // namespace rackrun::worker
