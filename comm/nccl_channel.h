// The NCCL backend: GPU ranks, one CUDA device per rank. Collectives map to NCCL's
// (ncclAllGather, ncclAllReduce, ncclBroadcast); all-to-all-v and point-to-point are
// grouped ncclSend/ncclRecv. Every call is enqueued on the channel's CUDA stream and
// waited for by polling the stream (and the communicator's async error) until the
// channel's timeout; on expiry the communicator is aborted and the channel is broken.
//
// Differences from the MPI backend that callers must respect:
// - NCCL matches point-to-point messages in issue order per pair, not by tag
//   (matches_by_tag() is false): ExecuteFanout picks its round pacing for this.
// - Requests posted inside GroupStart/GroupEnd start only at GroupEnd.
// - AllReduce uses NCCL's own algorithm: deterministic run to run for a fixed
//   communicator, NCCL version and NCCL_ALGO/NCCL_PROTO, but not bit-identical to the MPI
//   backend's fixed rank-order sum.
// - NCCL refuses two ranks of one communicator on the same GPU.
#ifndef RACKRUN_COMM_NCCL_CHANNEL_H_
#define RACKRUN_COMM_NCCL_CHANNEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/data_channel.h"
#include "comm/rendezvous_store.h"

namespace rackrun::comm {

struct NcclChannelOptions {
  ChannelOptions channel;
  // CUDA device of this rank.
  int device = 0;
  // false: every buffer passed to the channel is device memory on `device` (training).
  // true: buffers are host memory, staged through device scratch on every call (the
  // token-dispatch and fan-out code paths, and the backend-independent tests); AllToAllV's,
  // Isend's and Irecv's buffers may also be device memory of `device`, used as they are
  // (takes_device_buffers: expert parallelism's rows and weights on the GPU), told apart by
  // cudaPointerGetAttributes.
  bool host_buffers = false;
};

// Collective over `bootstrap` (normally the MPI channel): rank 0 creates the NCCL unique
// id and broadcasts it; the NCCL communicator has bootstrap's ranks. Internal/Unavailable
// naming the CUDA or NCCL call on failure; DeadlineExceeded if initialization outlasts
// the timeout.
absl::StatusOr<std::unique_ptr<DataChannel>> CreateNcclChannel(DataChannel& bootstrap,
                                                               const NcclChannelOptions& options);

// Collective over the `size` ranks that call it with the same `prefix` (one per job and
// channel), bootstrapped from a rendezvous store instead of a channel (the worker
// daemons' path): rank 0 creates the NCCL unique id and sets it under
// "<prefix>/nccl/unique_id"; every rank gets it and joins the communicator. The timeout
// bounds waiting for the id and the communicator's initialization together.
// InvalidArgument for a bad rank/size or a malformed id in the store; DeadlineExceeded
// if rank 0 never publishes the id or initialization outlasts the timeout;
// Internal/Unavailable naming the CUDA, NCCL or store call otherwise.
absl::StatusOr<std::unique_ptr<DataChannel>> CreateNcclChannel(RendezvousStore& store,
                                                               const std::string& prefix, int rank,
                                                               int size,
                                                               const NcclChannelOptions& options);

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_NCCL_CHANNEL_H_
