// Contract checks for the backends whose ranks meet through a RendezvousStore (Gloo, UCX),
// written once and run by each backend's test with its own factory: the shared collective
// checks on 1, 2 and 4 ranks as threads, AllReduce bit-identical to the in-process
// backend, and the failures a worker daemon lives through (ranks that never join, a peer
// that never posts, a peer whose channel is destroyed, a peer process killed with
// SIGKILL; after each the channel is destroyed and a new one works).
#ifndef RACKRUN_COMM_STORE_CHANNEL_CHECKS_H_
#define RACKRUN_COMM_STORE_CHANNEL_CHECKS_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/data_channel.h"
#include "comm/rendezvous_store.h"

namespace rackrun::comm::testing {

// Creates rank `rank` of `size` of a channel under `prefix` with `timeout` (the
// backend's Create*Channel with options for 127.0.0.1).
using StoreChannelFactory = std::function<absl::StatusOr<std::unique_ptr<DataChannel>>(
    RendezvousStore& store, const std::string& prefix, int rank, int size, absl::Duration timeout)>;

// Creates an n-rank channel with one thread per rank, runs body(channel) on each, and
// destroys the channels only after every body is done (so a rank that finishes early
// does not close connections others still use), each in its own thread, all together (a
// closing UCX channel waits for its peers to close). First error in rank order.
absl::Status RunStoreRanks(const StoreChannelFactory& factory, RendezvousStore& store,
                           const std::string& prefix, int ranks, absl::Duration timeout,
                           const std::function<absl::Status(DataChannel&)>& body);

// `check` on every rank of a `ranks`-rank channel whose backend() is `backend`.
void CheckOnRanks(const StoreChannelFactory& factory, int ranks, absl::string_view backend,
                  const std::function<void(DataChannel&)>& check);

// The same float32 sums as the in-process backend, compared byte for byte (3 ranks).
void CheckAllReduceEqualsInProcessBitForBit(const StoreChannelFactory& factory);
void CheckCountsCollectivesForProgress(const StoreChannelFactory& factory);
void CheckJobsWithDifferentPrefixesShareOneStore(const StoreChannelFactory& factory);
// CheckSilentRankTimesOut (channel_checks.h) on 2 and 4 ranks.
void CheckSilentRankTimesOutNamingIt(const StoreChannelFactory& factory);
void CheckRejectsBadRank(const StoreChannelFactory& factory);
void CheckRanksThatNeverJoinAreNamed(const StoreChannelFactory& factory);
// Rank 1 builds its channel and never posts: rank 0 times out naming it, the channel
// stays broken, tears down at once, and the next channel in this process works.
void CheckPeerThatNeverPostsThenTeardownAndNextChannel(const StoreChannelFactory& factory);
// Rank 1's channel is destroyed: rank 0 fails naming it (the closed connection, or at
// the latest the timeout) and then builds a new channel.
void CheckPeerChannelDestroyedFailsTheSurvivor(const StoreChannelFactory& factory);
// Forks and execs this test binary with `--gtest_filter=<child_test>` (a disabled test
// that calls RunAsKilledChild with the same factory) as rank 1, kills it with SIGKILL
// while rank 0 is in an AllReduce, and expects Unavailable naming rank 1 before the
// timeout.
void CheckPeerProcessKilledFailsTheSurvivor(const StoreChannelFactory& factory,
                                            const std::string& child_test);
void RunAsKilledChild(const StoreChannelFactory& factory);
// The same, the peer killed while the two ranks exchange large messages back to back
// (all-reduces of 8 MiB and 128 KiB in turn; UCX's rendezvous and eager paths): the
// survivor gets Unavailable naming rank 1 before the timeout, without aborting or hanging,
// and tears down within the timeout.
// The child test calls RunAsKilledChild too (the mode comes in the environment).
// `receive_in_flight_waits_for_the_timeout`: the transport does not fail a receive whose
// message is arriving when the connection breaks (Gloo's tcp pair signals its queued
// operations, not the one it is reading into), so the survivor may instead get
// DeadlineExceeded at the channel's timeout; it still names rank 1 and neither aborts nor
// hangs past the timeout.
void CheckPeerProcessKilledMidTransferFailsTheSurvivor(
    const StoreChannelFactory& factory, const std::string& child_test,
    bool receive_in_flight_waits_for_the_timeout = false);
// Rank 1 sends small and large messages, waits for its sends and destroys its channel at
// once; rank 0 posts its receives only afterwards (300 ms later): every message arrives
// intact, and both channels close.
void CheckMessagesSentBeforeCloseArrive(const StoreChannelFactory& factory);

}  // namespace rackrun::comm::testing

#endif  // RACKRUN_COMM_STORE_CHANNEL_CHECKS_H_
