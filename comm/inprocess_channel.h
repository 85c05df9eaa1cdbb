// The in-process backend: n ranks as threads of one process, exchanging messages through
// shared mailboxes. For unit tests only: it runs the same collectives (p2p_channel.h) and
// the same matching rules as the MPI backend without launching processes.
#ifndef RACKRUN_COMM_INPROCESS_CHANNEL_H_
#define RACKRUN_COMM_INPROCESS_CHANNEL_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/data_channel.h"

namespace rackrun::comm {

// One channel per rank, all connected. Channel r must be used by one thread at a time
// (normally a thread per rank). Sends copy eagerly and complete at once; receives
// complete when a matching message has arrived. InvalidArgument if `ranks` < 1.
absl::StatusOr<std::vector<std::unique_ptr<DataChannel>>> CreateInProcessChannels(
    int ranks, const ChannelOptions& options = {});

// Runs body(channel) on one thread per rank and joins them; returns the first non-OK
// status in rank order, or the creation error.
absl::Status RunInProcessRanks(int ranks, const ChannelOptions& options,
                               const std::function<absl::Status(DataChannel&)>& body);

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_INPROCESS_CHANNEL_H_
