// The Gloo backend: CPU ranks of one job connected over TCP by Gloo (the per-job data
// channel of the worker daemons). The ranks find each other through a RendezvousStore
// (the coordinator's, in production), so the channel can be built and torn down many
// times in one long-lived process.
//
// Transport: Gloo's unbound buffers over a full mesh of TCP pairs. A message to (peer,
// tag) starts with a fixed-size header (1032 bytes) on a slot derived from the tag: its
// size, and the payload itself when it is at most 1 KiB (then the message is this one Gloo
// message). A larger payload follows on the next slot, straight into the receiver's
// buffer once the header has shown that the sizes agree (Gloo's unbound buffers are a
// rendezvous: the payload moves only after the receiver has posted it). Gloo matches
// messages of one (peer, slot) in order, which gives MPI's non-overtaking rule. Messages
// to this rank itself never touch Gloo. The collectives are those of p2p_channel.h
// (named-peer timeouts, fixed summation order, so AllReduce is bit-identical to the MPI
// and in-process backends).
//
// Request::Test never blocks. Gloo (Debian 12's libgloo-dev, git 2022-05-18) has no
// completion test: its waits close every connection when they time out, and the tcp
// transport's headers that hold the completion state are not packaged. So each pending
// transfer is waited for by a pooled thread of the channel, which publishes the outcome,
// notifies the channel's completion event (the rank's waits block on it: comm/progress.h)
// and destroys the Gloo buffer (whose destructor spins until Gloo's loop thread lets go).
//
// Failures:
// - Every Gloo exception is caught in gloo_channel.cc and returned as a Status naming the
//   operation, this rank and the peer; nothing throws out of comm.
// - A peer that dies closes its TCP connections: pending and later transfers with it fail
//   with Unavailable at once (not only at the timeout). Gloo writes without MSG_NOSIGNAL,
//   so the first channel created sets SIGPIPE to ignored unless the process has its own
//   handler; otherwise a write to a dead peer would kill this process.
// - Destroying the channel never waits for peers; a worker whose job failed destroys the
//   broken channel and builds the next job's.
// - Destroying an incomplete request: a receive whose payload has not started is
//   cancelled cleanly (its message is drained and dropped when it arrives); otherwise
//   Gloo cannot cancel the transfer, so its buffer is released and further transfers with
//   that peer fail with FailedPrecondition.
#ifndef RACKRUN_COMM_GLOO_CHANNEL_H_
#define RACKRUN_COMM_GLOO_CHANNEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/data_channel.h"
#include "comm/rendezvous_store.h"

namespace rackrun::comm {

struct GlooChannelOptions {
  // The channel's timeout bounds creation (waiting for every rank to join and connecting)
  // as well as every later wait.
  ChannelOptions channel;
  // Hostname or IP address this rank listens on and announces to its peers; it must be
  // reachable from them. Tests use "127.0.0.1". The listening socket is bound to this
  // address only, never to every interface: a wildcard (0.0.0.0, ::) is refused.
  std::string address = "127.0.0.1";
  // Network interface to bind instead of `address` (e.g. "eth0"); empty: use `address`.
  std::string interface;
  // Who this rank is, for its peers' messages when they cannot connect to it (the worker
  // says "worker w-1 on host h2"); announced with `address`. Empty: the address alone.
  std::string label;
};

// Collective over the `size` ranks that call it with the same `store` contents and
// `prefix` (one prefix per job and channel: "job/<id>/attempt/<n>"). Each rank announces
// itself under `prefix`, waits for all ranks, then connects to every peer.
// InvalidArgument for a bad rank/size or a wildcard address; DeadlineExceeded naming the ranks that
// did not join within the timeout; Unavailable naming the Gloo call (bind, connect) otherwise. A
// failed connect also names the peers as they announced themselves (address, label).
// InvalidArgument, before connecting, when this host has no route to a peer's announced
// address, naming that peer (its address and label).
// The store is used only during this call.
absl::StatusOr<std::unique_ptr<DataChannel>> CreateGlooChannel(RendezvousStore& store,
                                                               const std::string& prefix, int rank,
                                                               int size,
                                                               const GlooChannelOptions& options);

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_GLOO_CHANNEL_H_
