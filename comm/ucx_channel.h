// The UCX backend: CPU ranks of one job connected by UCX's UCP tag API (the per-job data
// channel of the worker daemons, beside Gloo). UCX chooses the transport per peer at run
// time from what the machine offers: shared memory between ranks of one host, TCP (or
// verbs) across hosts, loopback to this rank itself; UCX_TLS and the other UCX_*
// variables of the environment apply as usual, and nothing needs setting.
//
// Bootstrap (like the Gloo channel): each rank publishes its host identity (the kernel's
// boot id and its network namespace: two namespaces of one machine are two hosts) and its
// UCP data and watch worker addresses (hex) under `prefix` in a RendezvousStore, waits for
// every rank's, and creates endpoints to every rank (itself included):
// - a rank on another host: one endpoint with UCX's peer error handling (TCP or verbs,
//   on the interface of the data address);
// - a rank on this host: a data endpoint without error handling, which UCX carries over
//   shared memory, and a watch endpoint with it, which carries nothing but UCX's TCP
//   connection and keepalive (between the ranks' watch workers: see Transport). UCX 1.13
//   handles peer failure only on transports that can detect it, so one endpoint asking for
//   it would move every message over TCP (7x the latency of shared memory here;
//   comm/README.md).
// Rendezvous (large messages) runs without zero-copy lanes (as UCX_MAX_RNDV_RAILS=0):
// UCX's CMA reads of a peer's memory abort the process when that peer dies mid-transfer.
// Without lanes, messages up to 1 MiB go eagerly through 32 KiB shared-memory segments
// (UCX_RNDV_THRESH=1m, UCX_MM_SEG_SIZE=32832), as fast as Open MPI's shared memory
// (comm/README.md). Each of these settings yields to its UCX_* variable when set.
//
// Transport: per channel, a UCP context and worker for the data and a TCP-only context and
// worker for the watch endpoints (a worker with a TCP endpoint polls its sockets on every
// progress call, which tripled the time of shared-memory messages), both driven only by
// the rank's thread (single-threaded workers, no helper threads of ours). A message to
// (peer, tag) is one UCP tag message whose 64-bit tag holds the sender's rank and the tag;
// UCP matches messages of one sender in send order, which gives MPI's non-overtaking rule.
// Request::Test() calls ucp_worker_progress once (and the watch worker's every
// millisecond) and then checks the request, so the rank's wait loops (comm/progress.h,
// polling) drive the transfers. The collectives are those of p2p_channel.h (named-peer
// timeouts, fixed summation order, so AllReduce is bit-identical to the MPI, Gloo and
// in-process backends).
//
// Failures:
// - A peer that dies or closes its channel fails pending and later transfers with it with
//   Unavailable naming the operation, this rank and the peer, as soon as its endpoint with
//   error handling notices (a closed TCP connection at once, otherwise UCX's keepalive,
//   which this channel runs every second unless UCX_KEEPALIVE_INTERVAL is set), at the
//   latest at the channel's timeout. A peer that is alive but never posts is found by the
//   timeout, as on every backend.
// - A message larger or smaller than the posted receive fails that receive with
//   InvalidArgument and is consumed; the next message of the pair is intact.
// - A peer that closed its channel (see Closing) fails this rank's receives from it that
//   no message of its matches, at once, with Unavailable "rank P closed its channel".
// - Destroying an incomplete receive cancels it; an incomplete send is left to UCX (its
//   buffer must live until the channel is destroyed).
//
// Closing (the destructor): a closing handshake, so that what a rank sent before closing
// arrives although the rank closes at once (a finished rank's part of the job's last
// collective). Each rank sends a "bye" to every peer, after all its other messages, and
// waits, bounded by the channel's timeout, until every peer's bye has arrived or that peer
// failed (died: its error-handling endpoint says so); then closes its endpoints, in flush
// mode to the peers that said bye, forcibly to the others, so closing never hangs. A
// broken channel (a collective failed) does not wait for the peers' byes. Destroying the
// channels of one job's ranks one after another in one thread would wait the timeout for
// each: every rank closes its own channel.
#ifndef RACKRUN_COMM_UCX_CHANNEL_H_
#define RACKRUN_COMM_UCX_CHANNEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/data_channel.h"
#include "comm/rendezvous_store.h"

namespace rackrun::comm {

struct UcxChannelOptions {
  // The channel's timeout bounds creation (waiting for every rank to publish its address)
  // as well as every later wait.
  ChannelOptions channel;
  // Where peers on other machines reach this rank (the worker's data address). An IP
  // address of one of this machine's interfaces restricts UCX's network transports to
  // that interface (as UCX_NET_DEVICES=<interface> would); empty or a host name: UCX uses
  // every interface it finds. UCX_NET_DEVICES in the environment wins. UCX 1.13's TCP
  // transport then listens and is reached on the interface's first address of that family
  // (UcxInterfaceOf, data_address.h), which is the data address unless that is a second
  // address of its interface: UCX takes one address per interface and offers no way to
  // pick another.
  std::string address;
  // Who this rank is, for the peers' errors (the worker daemon says "worker w-1 on host
  // h2"); announced with `address`. Empty: the address alone.
  std::string label;
};

// Collective over the `size` ranks that call it with the same `store` contents and
// `prefix` (one prefix per job and channel: "job/<id>/attempt/<n>"). Each rank publishes
// its UCP worker addresses with its data address, the address UCX uses and its label;
// once all have, a rank checks that this host has a route to every peer on another host
// (its data address, and the address UCX uses when that differs) and fails at once with
// InvalidArgument naming each peer it cannot reach: rank, address, label (as the Gloo
// channel does; before, UCX's wire-up stalled until a timeout named another rank).
// InvalidArgument also for a bad rank/size or an IP address that is none of this
// machine's; DeadlineExceeded naming the ranks that did not publish their address within
// the timeout; Unavailable naming the UCX call, and the peer as it announced itself, that
// failed otherwise. The store is used only during this call.
absl::StatusOr<std::unique_ptr<DataChannel>> CreateUcxChannel(RendezvousStore& store,
                                                              const std::string& prefix, int rank,
                                                              int size,
                                                              const UcxChannelOptions& options);

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_UCX_CHANNEL_H_
