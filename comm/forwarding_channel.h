// ForwardingChannel: the base of a DataChannel decorator. Every call goes to `inner` as it is;
// a decorator overrides only the calls it changes (the fan-out bench's emulated egress link, the
// GPU tests' channel that takes device buffers).
//
// - progress() is not counted here: the inner channel counts its own collectives.
// - completion_event() is not forwarded: a decorator's own requests poll, and a wait loop must
//   not block on an event they never report.
// - Split is not forwarded (the inner channel's sub-channel would bypass the decorator): it
//   answers Unimplemented, DataChannel's default. A decorator that splits wraps the inner
//   channel's sub-channel in a decorator of its own that owns it (the owning constructor):
//   `return SplitInto<MyDecorator>(color, key);`.
// `inner` must outlive the decorator.
#ifndef RACKRUN_COMM_FORWARDING_CHANNEL_H_
#define RACKRUN_COMM_FORWARDING_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/data_channel.h"

namespace rackrun::comm {

class ForwardingChannel : public DataChannel {
 public:
  explicit ForwardingChannel(DataChannel& inner)
      : DataChannel(ChannelOptions{inner.timeout()}), inner_(inner) {}
  // Owns `inner` (a sub-channel of the channel a decorator wraps).
  explicit ForwardingChannel(std::unique_ptr<DataChannel> inner)
      : DataChannel(ChannelOptions{inner->timeout()}), inner_(*inner), owned_(std::move(inner)) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  absl::string_view backend() const override { return inner_.backend(); }
  bool matches_by_tag() const override { return inner_.matches_by_tag(); }
  bool takes_device_buffers() const override { return inner_.takes_device_buffers(); }
  absl::Status Allgather(const void* send, void* recv, int64_t count, DataType type) override {
    return inner_.Allgather(send, recv, count, type);
  }
  absl::Status AllToAllV(const void* send, std::span<const int64_t> send_counts,
                         std::span<const int64_t> send_displs, void* recv,
                         std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                         DataType type) override {
    return inner_.AllToAllV(send, send_counts, send_displs, recv, recv_counts, recv_displs, type);
  }
  absl::Status AllReduce(const void* send, void* recv, int64_t count, DataType type,
                         ReduceOp op) override {
    return inner_.AllReduce(send, recv, count, type, op);
  }
  absl::Status Broadcast(void* buf, int64_t count, DataType type, int root) override {
    return inner_.Broadcast(buf, count, type, root);
  }
  absl::Status Barrier() override { return inner_.Barrier(); }
  absl::StatusOr<std::unique_ptr<Request>> Isend(const void* buf, int64_t count, DataType type,
                                                 int peer, int tag) override {
    return inner_.Isend(buf, count, type, peer, tag);
  }
  absl::StatusOr<std::unique_ptr<Request>> Irecv(void* buf, int64_t count, DataType type, int peer,
                                                 int tag) override {
    return inner_.Irecv(buf, count, type, peer, tag);
  }
  absl::Status GroupStart() override { return inner_.GroupStart(); }
  absl::Status GroupEnd() override { return inner_.GroupEnd(); }

 protected:
  DataChannel& inner() { return inner_; }
  // The inner channel's sub-channel in a new D that owns it (D(std::unique_ptr<DataChannel>)).
  template <typename D>
  absl::StatusOr<std::unique_ptr<DataChannel>> SplitInto(int color, int key) {
    absl::StatusOr<std::unique_ptr<DataChannel>> sub = inner_.Split(color, key);
    if (!sub.ok()) return sub.status();
    return std::unique_ptr<DataChannel>(std::make_unique<D>(*std::move(sub)));
  }

 private:
  DataChannel& inner_;
  std::unique_ptr<DataChannel> owned_;  // null unless this decorator owns inner_
};

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_FORWARDING_CHANNEL_H_
