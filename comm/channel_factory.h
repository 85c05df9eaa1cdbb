// CreateChannel: a data channel of one job, chosen by name (channel_names.h) and
// bootstrapped from a rendezvous store: the worker daemon's one way to build the channel of
// an attempt, so it includes none of the backends. Each backend's header says what its
// channel does on failure; this file only chooses one and hands it its options.
#ifndef RACKRUN_COMM_CHANNEL_FACTORY_H_
#define RACKRUN_COMM_CHANNEL_FACTORY_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "comm/channel_names.h"
#include "comm/data_channel.h"
#include "comm/rendezvous_store.h"

namespace rackrun::comm {

// What any backend needs to join a job's channel; each backend reads the fields it knows.
struct ChannelSetup {
  // One prefix per job and attempt ("job/<id>/attempt/<n>"): the ranks' keys in the store.
  std::string prefix;
  int rank = 0;
  int size = 1;
  // Bounds creation (waiting for every rank) as well as every later wait.
  ChannelOptions channel;
  // Where peers on other machines reach this rank (the worker's --data-address). UCX:
  // restricts its network transports to the interface of this address (empty: every
  // interface). Gloo: the address it listens on and announces (empty: 127.0.0.1).
  std::string address;
  // Who this rank is, in its peers' errors ("worker w-1 on host h2"; UCX, Gloo).
  std::string label;
  // NCCL: the CUDA device of this rank, and whether the buffers handed to the channel are
  // host memory (the CPU trainer's) rather than device memory.
  int device = 0;
  bool host_buffers = true;
};

// Whether this build has the backend of `kind` (NCCL needs CUDA and NCCL at build time).
bool ChannelBuilt(ChannelKind kind);

// Collective over the `setup.size` ranks that call it with the same `store` and prefix:
// the channel named `name` (ChannelOrDefault applies: "" is the default channel).
// InvalidArgument for a name that is not in kChannels (naming resources.channel and the
// choices); FailedPrecondition for a channel this build lacks (ChannelBuilt), naming
// `setup.label`; otherwise the backend's own errors (ucx_channel.h, gloo_channel.h,
// nccl_channel.h).
absl::StatusOr<std::unique_ptr<DataChannel>> CreateChannel(std::string_view name,
                                                           RendezvousStore& store,
                                                           const ChannelSetup& setup);

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_CHANNEL_FACTORY_H_
