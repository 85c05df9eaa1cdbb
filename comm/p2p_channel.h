// Collectives built from point-to-point messages, shared by the backends whose transport
// is point-to-point (MPI, Gloo, in-process). Building them here rather than calling the
// transport's own collectives buys two properties the job relies on:
// - every wait knows exactly which peer's message is missing, so a timeout names it;
// - AllReduce has one fixed summation order, so results are bit-identical on every rank
//   and run to run, independent of the transport's algorithm choice.
//
// Algorithms (n ranks, all direct exchanges; n is a rack, not a datacenter):
// - Allgather, AllToAllV: every rank posts one receive per peer and one send per peer.
// - Broadcast: the root sends to every other rank.
// - Barrier: every rank exchanges an empty message with every other rank.
// - AllReduce (sum): reduce-scatter then allgather. The buffer is cut into n contiguous
//   blocks; rank b owns block b, receives block b from every rank and sums the
//   contributions in ascending rank order (acc = x_0; acc += x_1; ...; acc += x_{n-1}),
//   then every rank receives each owner's block verbatim. Each element is thus summed
//   exactly once, in the same order, whatever the rank count's timing.
//
// Sub-groups (Split) are built the same way for every such backend: a sub-channel posts
// its messages on the transport of the channel at the root of the splits, to its members'
// root ranks, with its tags shifted into a range of its own: tag + index *
// kSubChannelTagStride, where index >= 1 is agreed by the splitting ranks as the largest
// next-index any of them holds (each rank's counter lives at the root and only grows). Two
// sub-channels that share a pair of ranks therefore never share an index: the later split
// saw both ranks' counters past the earlier one's. The channel itself uses index 0.
#ifndef RACKRUN_COMM_P2P_CHANNEL_H_
#define RACKRUN_COMM_P2P_CHANNEL_H_

#include <limits>
#include <memory>
#include <string>

#include "comm/data_channel.h"

namespace rackrun::comm {

// Tags per channel of a split tree: a channel's user tags and its collectives' reserved
// tags all lie below it.
inline constexpr int kSubChannelTagStride = 1 << 15;

class SubChannel;

class PointToPointChannel : public DataChannel {
 public:
  absl::Status Allgather(const void* send, void* recv, int64_t count, DataType type) override;
  absl::Status AllToAllV(const void* send, std::span<const int64_t> send_counts,
                         std::span<const int64_t> send_displs, void* recv,
                         std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                         DataType type) override;
  absl::Status AllReduce(const void* send, void* recv, int64_t count, DataType type,
                         ReduceOp op) override;
  absl::Status Broadcast(void* buf, int64_t count, DataType type, int root) override;
  absl::Status Barrier() override;
  absl::StatusOr<std::unique_ptr<Request>> Isend(const void* buf, int64_t count, DataType type,
                                                 int peer, int tag) override;
  absl::StatusOr<std::unique_ptr<Request>> Irecv(void* buf, int64_t count, DataType type, int peer,
                                                 int tag) override;
  absl::StatusOr<std::unique_ptr<DataChannel>> Split(int color, int key) override;

 protected:
  explicit PointToPointChannel(const ChannelOptions& options) : DataChannel(options) {}

  // True once a collective of this channel failed (not counting bad arguments): its peers
  // are dead, silent or failing, and the job must stop.
  bool broken() const { return !broken_.ok(); }

  // The largest tag the transport accepts (MPI: MPI_TAG_UB); bounds the number of splits.
  virtual int max_transport_tag() const { return std::numeric_limits<int>::max(); }

  // The transport: post a send/receive of `bytes` bytes with any tag >= 0 (collectives use
  // tags >= kMaxUserTag). Arguments are already checked.
  virtual absl::StatusOr<std::unique_ptr<Request>> PostSend(const void* buf, int64_t bytes,
                                                            int peer, int tag) = 0;
  virtual absl::StatusOr<std::unique_ptr<Request>> PostRecv(void* buf, int64_t bytes, int peer,
                                                            int tag) = 0;

 private:
  // The algorithms above; the public collectives wrap them with the progress() counts.
  absl::Status AllgatherImpl(const void* send, void* recv, int64_t count, DataType type);
  absl::Status AllToAllVImpl(const void* send, std::span<const int64_t> send_counts,
                             std::span<const int64_t> send_displs, void* recv,
                             std::span<const int64_t> recv_counts,
                             std::span<const int64_t> recv_displs, DataType type);
  absl::Status AllReduceImpl(const void* send, void* recv, int64_t count, DataType type,
                             ReduceOp op);
  absl::Status BroadcastImpl(void* buf, int64_t count, DataType type, int root);
  absl::Status BarrierImpl();
  // A collective's result: breaks the channel on failure (except InvalidArgument) and
  // counts the completion for progress().
  absl::Status Conclude(absl::Status status);

  // FailedPrecondition quoting the first timeout once the channel is broken.
  absl::Status CheckUsable(absl::string_view operation) const;
  // Waits for `requests`; a timeout breaks the channel.
  absl::Status Finish(std::span<const std::unique_ptr<Request>> requests, absl::Time deadline,
                      absl::string_view operation);

  // The channel whose transport carries this one's messages, and this channel's rank `r`
  // there (the identity for a channel that was not split off another).
  virtual PointToPointChannel& root() { return *this; }
  virtual int RootRank(int r) const { return r; }

  friend class SubChannel;

  absl::Status broken_;
  int64_t next_split_index_ = 1;  // at the root: the next index this rank may propose
};

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_P2P_CHANNEL_H_
