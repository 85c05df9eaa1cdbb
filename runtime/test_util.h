// What the runtime's tests and the GPU engine's (runtime/cuda/) share: expert-parallel
// trainers on in-process ranks, each over its in-process channel or a decorator of it.
#ifndef RACKRUN_RUNTIME_TEST_UTIL_H_
#define RACKRUN_RUNTIME_TEST_UTIL_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/data_channel.h"
#include "comm/inprocess_channel.h"
#include "gtest/gtest.h"
#include "rackrun/v1/job_spec.pb.h"
#include "runtime/trainer.h"

namespace rackrun::runtime::testing {

struct RanksRun {
  std::vector<double> losses;        // rank 0's; every rank's must be equal
  bool gradients_on_device = false;  // every rank's Trainer::reduces_gradients_on_device()
};

// A rank's channel made of its in-process channel (a decorator); null: that channel itself.
using ChannelWrapper =
    std::function<std::unique_ptr<comm::DataChannel>(comm::DataChannel& in_process)>;

// Trains `spec` with Trainer::Run on `ranks` in-process ranks, each resumed from `resume` when
// set. Fails the test when a rank fails, when ranks log different losses or when only some
// ranks reduce their gradients on the device.
inline RanksRun RunTrainerRanks(int ranks, const rackrun::v1::JobSpec& spec,
                                const TrainerOptions& options, const ChannelWrapper& wrap = nullptr,
                                const std::string& resume = "") {
  std::vector<std::vector<double>> losses(static_cast<size_t>(ranks));
  std::atomic<int> on_device{0};
  const absl::Status s = comm::RunInProcessRanks(ranks, {}, [&](comm::DataChannel& in_process) {
    const std::unique_ptr<comm::DataChannel> wrapped = wrap ? wrap(in_process) : nullptr;
    comm::DataChannel& ch = wrapped != nullptr ? *wrapped : in_process;
    absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(spec, &ch, options);
    if (!t.ok()) return t.status();
    if ((*t)->reduces_gradients_on_device()) ++on_device;
    if (!resume.empty()) {
      if (absl::Status r = (*t)->Resume(resume); !r.ok()) return r;
    }
    absl::StatusOr<TrainSummary> summary = (*t)->Run();
    if (!summary.ok()) return summary.status();
    losses[static_cast<size_t>(ch.rank())] = summary->losses;
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  for (int r = 1; r < ranks; ++r) EXPECT_EQ(losses[static_cast<size_t>(r)], losses[0]);
  EXPECT_TRUE(on_device == 0 || on_device == ranks) << on_device << " of " << ranks;
  return {losses[0], on_device == ranks};
}

}  // namespace rackrun::runtime::testing

#endif  // RACKRUN_RUNTIME_TEST_UTIL_H_
