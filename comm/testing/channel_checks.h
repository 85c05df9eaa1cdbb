// Backend-independent checks of the data-channel contract, token dispatch and relay
// fan-out, written once and run on every backend: in-process (threads), MPI (mpirun, 2 and
// 4 ranks) and NCCL (tools/gpu-check). Each function is called by every rank of the
// channel with the same arguments and reports through GoogleTest assertions.
#ifndef RACKRUN_COMM_CHANNEL_CHECKS_H_
#define RACKRUN_COMM_CHANNEL_CHECKS_H_

#include <cstdint>

#include "comm/data_channel.h"
#include "comm/fanout_executor.h"
#include "comm/token_dispatch.h"
#include "planner/plan.h"

namespace rackrun::comm::testing {

// Collectives against values each rank can compute for itself.
void CheckAllgather(DataChannel& channel);
void CheckAllToAllV(DataChannel& channel);
void CheckBroadcast(DataChannel& channel);
void CheckBarrier(DataChannel& channel);
// AllReduce of int64 is exact; float32 sums equal the rank-order reference bit for bit
// when `fixed_order` (MPI, in-process), and are close to it otherwise (NCCL); repeated
// calls give bit-identical results either way.
void CheckAllReduce(DataChannel& channel, bool fixed_order);
// Non-blocking send/recv in a ring and to self, several tags, messages posted before the
// receive exists and after; Test/Wait; size mismatch is an error.
void CheckSendRecv(DataChannel& channel);
// Bad arguments give InvalidArgument naming the argument.
void CheckBadArguments(DataChannel& channel);

// Sub-groups: splits `channel` into consecutive groups of `group` ranks (color rank /
// group, as expert-parallel domains) and into strided ones (color rank % group, the ranks
// holding the same shard in each domain), runs the collective and send/receive checks
// above on each sub-channel, checks that sums and gathers cover exactly the group's ranks,
// that a message on the channel and one on a sub-channel with the same peer and tag never
// match each other, that a sub-channel can be split again, and that a negative color is
// refused on every rank. `group` must divide channel.size(). `fixed_order`: the backend's
// AllReduce is the rank-order sum (as CheckAllReduce).
void CheckSubChannels(DataChannel& channel, int group, bool fixed_order = true);

// Rank `silent` skips an Allgather (and a Recv the others wait on); every other rank gets
// DeadlineExceeded within the channel's timeout naming the operation and "rank <silent>".
// Breaks the channel on the other ranks: run it on a channel of its own.
void CheckSilentRankTimesOut(DataChannel& channel, int silent);

// A random but valid plan for `ranks` ranks: every expert has its master at home and up
// to `slots_per_rank` replicas per rank elsewhere, and each (src, expert) load is split
// across the expert's instances at random. Deterministic in `seed`. `loads` gets the
// load matrix it was built from.
planner::Plan RandomPlan(int ranks, int masters_per_rank, int slots_per_rank, int tokens_per_rank,
                         int top_k, uint64_t seed, std::vector<TokenRouting>* routings);

// Dispatch + a linear expert (y = W_e x + b_e, distinct per expert) + combine equals the
// same computation done at home, exactly (float results compared bit for bit), for a
// random plan (hand-built, and the planner's ultraep policy when `use_ultraep`).
void CheckTokenDispatch(DataChannel& channel, uint64_t seed, bool use_ultraep);

// Every replica of a schedule receives bit-identical weight bytes.
void CheckRelayFanout(DataChannel& channel, FanoutPacing pacing);

}  // namespace rackrun::comm::testing

#endif  // RACKRUN_COMM_CHANNEL_CHECKS_H_
