#include "comm/p2p_channel.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace rackrun::comm {
namespace {

// Reserved tags, one per collective phase. Messages between a pair of ranks with the same
// tag never overtake each other, so consecutive collectives of one kind need no sequence
// number.
enum CollectiveTag : int {
  kTagAllgather = kMaxUserTag + 1,
  kTagAllToAllV,
  kTagReduceScatter,
  kTagReduceGather,
  kTagBroadcast,
  kTagBarrier,
};

// First element of block b when `count` elements are cut into n contiguous blocks.
int64_t BlockStart(int64_t count, int n, int b) { return count * b / n; }

template <typename T>
void SumInRankOrder(const std::vector<std::byte>& contributions, int n, int64_t elements,
                    std::byte* out) {
  const T* x = reinterpret_cast<const T*>(contributions.data());
  T* acc = reinterpret_cast<T*>(out);
  // acc = x_0; acc += x_1; ... in ascending rank order: the one summation order.
  for (int64_t i = 0; i < elements; ++i) acc[i] = x[i];
  for (int r = 1; r < n; ++r) {
    const T* xr = x + static_cast<size_t>(r) * static_cast<size_t>(elements);
    for (int64_t i = 0; i < elements; ++i) acc[i] += xr[i];
  }
}

}  // namespace

absl::Status PointToPointChannel::CheckUsable(absl::string_view operation) const {
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(operation, " on rank ", rank(),
                                                      ": channel is broken by an earlier error (",
                                                      broken_.message(), "); the job must stop"));
  }
  return absl::OkStatus();
}

absl::Status PointToPointChannel::Finish(std::span<const std::unique_ptr<Request>> requests,
                                         absl::Time deadline, absl::string_view operation) {
  absl::Status status = WaitAll(requests, deadline, operation);
  if (!status.ok() && broken_.ok()) broken_ = status;
  return status;
}

absl::StatusOr<std::unique_ptr<Request>> PointToPointChannel::Isend(const void* buf, int64_t count,
                                                                    DataType type, int peer,
                                                                    int tag) {
  if (absl::Status s = CheckUsable("Isend"); !s.ok()) return s;
  if (absl::Status s = CheckPeer("Isend", peer); !s.ok()) return s;
  if (absl::Status s = CheckTag("Isend", tag); !s.ok()) return s;
  if (absl::Status s = CheckCount("Isend", count); !s.ok()) return s;
  return PostSend(buf, count * static_cast<int64_t>(DataTypeSize(type)), peer, tag);
}

absl::StatusOr<std::unique_ptr<Request>> PointToPointChannel::Irecv(void* buf, int64_t count,
                                                                    DataType type, int peer,
                                                                    int tag) {
  if (absl::Status s = CheckUsable("Irecv"); !s.ok()) return s;
  if (absl::Status s = CheckPeer("Irecv", peer); !s.ok()) return s;
  if (absl::Status s = CheckTag("Irecv", tag); !s.ok()) return s;
  if (absl::Status s = CheckCount("Irecv", count); !s.ok()) return s;
  return PostRecv(buf, count * static_cast<int64_t>(DataTypeSize(type)), peer, tag);
}

// The public collectives count themselves for progress() around the algorithms below,
// and any failure but a bad argument breaks the channel: a transfer that could not be
// posted leaves the others of the collective in flight, so matching is undefined after it.
absl::Status PointToPointChannel::Conclude(absl::Status status) {
  if (!status.ok() && status.code() != absl::StatusCode::kInvalidArgument && broken_.ok()) {
    broken_ = status;
  }
  return CompleteCollective(std::move(status));
}

absl::Status PointToPointChannel::Allgather(const void* send, void* recv, int64_t count,
                                            DataType type) {
  EnterCollective();
  return Conclude(AllgatherImpl(send, recv, count, type));
}

absl::Status PointToPointChannel::AllToAllV(const void* send, std::span<const int64_t> send_counts,
                                            std::span<const int64_t> send_displs, void* recv,
                                            std::span<const int64_t> recv_counts,
                                            std::span<const int64_t> recv_displs, DataType type) {
  EnterCollective();
  return Conclude(
      AllToAllVImpl(send, send_counts, send_displs, recv, recv_counts, recv_displs, type));
}

absl::Status PointToPointChannel::AllReduce(const void* send, void* recv, int64_t count,
                                            DataType type, ReduceOp op) {
  EnterCollective();
  return Conclude(AllReduceImpl(send, recv, count, type, op));
}

absl::Status PointToPointChannel::Broadcast(void* buf, int64_t count, DataType type, int root) {
  EnterCollective();
  return Conclude(BroadcastImpl(buf, count, type, root));
}

absl::Status PointToPointChannel::Barrier() {
  EnterCollective();
  return Conclude(BarrierImpl());
}

absl::Status PointToPointChannel::AllgatherImpl(const void* send, void* recv, int64_t count,
                                                DataType type) {
  if (absl::Status s = CheckUsable("Allgather"); !s.ok()) return s;
  if (absl::Status s = CheckCount("Allgather", count); !s.ok()) return s;
  const absl::Time deadline = absl::Now() + timeout();
  const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(type));
  auto* out = static_cast<std::byte*>(recv);
  const int me = rank();
  std::vector<std::unique_ptr<Request>> requests;
  for (int p = 0; p < size(); ++p) {
    if (p == me) continue;
    absl::StatusOr<std::unique_ptr<Request>> r = PostRecv(out + p * bytes, bytes, p, kTagAllgather);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  for (int p = 0; p < size(); ++p) {
    if (p == me) continue;
    absl::StatusOr<std::unique_ptr<Request>> r = PostSend(send, bytes, p, kTagAllgather);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  if (bytes > 0 && out + me * bytes != send) std::memmove(out + me * bytes, send, bytes);
  return Finish(requests, deadline, "Allgather");
}

absl::Status PointToPointChannel::AllToAllVImpl(const void* send,
                                                std::span<const int64_t> send_counts,
                                                std::span<const int64_t> send_displs, void* recv,
                                                std::span<const int64_t> recv_counts,
                                                std::span<const int64_t> recv_displs,
                                                DataType type) {
  if (absl::Status s = CheckUsable("AllToAllV"); !s.ok()) return s;
  if (absl::Status s = CheckCountsAndDispls("AllToAllV", send_counts, send_displs, "send");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckCountsAndDispls("AllToAllV", recv_counts, recv_displs, "recv");
      !s.ok()) {
    return s;
  }
  const int me = rank();
  if (send_counts[me] != recv_counts[me]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AllToAllV on rank ", me, ": send_counts[", me, "]=", send_counts[me], " but recv_counts[",
        me, "]=", recv_counts[me], "; a rank's block to itself must have one size"));
  }
  const absl::Time deadline = absl::Now() + timeout();
  const auto elem = static_cast<int64_t>(DataTypeSize(type));
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  std::vector<std::unique_ptr<Request>> requests;
  for (int p = 0; p < size(); ++p) {
    if (p == me) continue;
    absl::StatusOr<std::unique_ptr<Request>> r =
        PostRecv(out + recv_displs[p] * elem, recv_counts[p] * elem, p, kTagAllToAllV);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  for (int p = 0; p < size(); ++p) {
    if (p == me) continue;
    absl::StatusOr<std::unique_ptr<Request>> r =
        PostSend(in + send_displs[p] * elem, send_counts[p] * elem, p, kTagAllToAllV);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  if (send_counts[me] > 0) {
    std::memmove(out + recv_displs[me] * elem, in + send_displs[me] * elem, send_counts[me] * elem);
  }
  return Finish(requests, deadline, "AllToAllV");
}

absl::Status PointToPointChannel::AllReduceImpl(const void* send, void* recv, int64_t count,
                                                DataType type, ReduceOp op) {
  if (absl::Status s = CheckUsable("AllReduce"); !s.ok()) return s;
  if (absl::Status s = CheckCount("AllReduce", count); !s.ok()) return s;
  if (type == DataType::kByte || op != ReduceOp::kSum) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllReduce on rank ", rank(), ": type ", DataTypeName(type),
                     " cannot be summed; use int32, int64, float32 or float64"));
  }
  const absl::Time deadline = absl::Now() + timeout();
  const int n = size();
  const int me = rank();
  const auto elem = static_cast<int64_t>(DataTypeSize(type));
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  const int64_t my_start = BlockStart(count, n, me);
  const int64_t my_elems = BlockStart(count, n, me + 1) - my_start;

  // Phase 1, reduce-scatter: contributions[r] = rank r's copy of my block.
  std::vector<std::byte> contributions(static_cast<size_t>(n * my_elems * elem));
  std::vector<std::unique_ptr<Request>> requests;
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    absl::StatusOr<std::unique_ptr<Request>> r =
        PostRecv(contributions.data() + p * my_elems * elem, my_elems * elem, p, kTagReduceScatter);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    const int64_t start = BlockStart(count, n, p);
    const int64_t elems = BlockStart(count, n, p + 1) - start;
    absl::StatusOr<std::unique_ptr<Request>> r =
        PostSend(in + start * elem, elems * elem, p, kTagReduceScatter);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  if (my_elems > 0) {
    std::memcpy(contributions.data() + me * my_elems * elem, in + my_start * elem, my_elems * elem);
  }
  if (absl::Status s = Finish(requests, deadline, "AllReduce"); !s.ok()) return s;
  requests.clear();

  // Every send of phase 1 has completed, so `recv` may now be written even if it aliases
  // `send`.
  std::byte* my_block = out + my_start * elem;
  switch (type) {
    case DataType::kInt32:
      SumInRankOrder<int32_t>(contributions, n, my_elems, my_block);
      break;
    case DataType::kInt64:
      SumInRankOrder<int64_t>(contributions, n, my_elems, my_block);
      break;
    case DataType::kFloat32:
      SumInRankOrder<float>(contributions, n, my_elems, my_block);
      break;
    case DataType::kFloat64:
      SumInRankOrder<double>(contributions, n, my_elems, my_block);
      break;
    case DataType::kByte:
      break;
  }

  // Phase 2, allgather of the owners' blocks, copied verbatim.
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    const int64_t start = BlockStart(count, n, p);
    const int64_t elems = BlockStart(count, n, p + 1) - start;
    absl::StatusOr<std::unique_ptr<Request>> r =
        PostRecv(out + start * elem, elems * elem, p, kTagReduceGather);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    absl::StatusOr<std::unique_ptr<Request>> r =
        PostSend(my_block, my_elems * elem, p, kTagReduceGather);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  return Finish(requests, deadline, "AllReduce");
}

absl::Status PointToPointChannel::BroadcastImpl(void* buf, int64_t count, DataType type, int root) {
  if (absl::Status s = CheckUsable("Broadcast"); !s.ok()) return s;
  if (absl::Status s = CheckCount("Broadcast", count); !s.ok()) return s;
  if (absl::Status s = CheckPeer("Broadcast root", root); !s.ok()) return s;
  const absl::Time deadline = absl::Now() + timeout();
  const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(type));
  std::vector<std::unique_ptr<Request>> requests;
  if (rank() == root) {
    for (int p = 0; p < size(); ++p) {
      if (p == root) continue;
      absl::StatusOr<std::unique_ptr<Request>> r = PostSend(buf, bytes, p, kTagBroadcast);
      if (!r.ok()) return r.status();
      requests.push_back(*std::move(r));
    }
  } else {
    absl::StatusOr<std::unique_ptr<Request>> r = PostRecv(buf, bytes, root, kTagBroadcast);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  return Finish(requests, deadline, "Broadcast");
}

absl::Status PointToPointChannel::BarrierImpl() {
  if (absl::Status s = CheckUsable("Barrier"); !s.ok()) return s;
  const absl::Time deadline = absl::Now() + timeout();
  std::vector<std::unique_ptr<Request>> requests;
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    absl::StatusOr<std::unique_ptr<Request>> r = PostRecv(nullptr, 0, p, kTagBarrier);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    absl::StatusOr<std::unique_ptr<Request>> r = PostSend(nullptr, 0, p, kTagBarrier);
    if (!r.ok()) return r.status();
    requests.push_back(*std::move(r));
  }
  return Finish(requests, deadline, "Barrier");
}

// A sub-group of a point-to-point channel (see Split in p2p_channel.h): its messages go
// over the root's transport, to its members' root ranks, with its tags shifted into its own
// range.
class SubChannel final : public PointToPointChannel {
 public:
  SubChannel(PointToPointChannel& root, std::vector<int> members, int rank, int tag_base,
             const ChannelOptions& options)
      : PointToPointChannel(options),
        root_(root),
        members_(std::move(members)),
        rank_(rank),
        tag_base_(tag_base) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  absl::string_view backend() const override { return root_.backend(); }
  const CompletionEvent* completion_event() const override { return root_.completion_event(); }

 protected:
  absl::StatusOr<std::unique_ptr<Request>> PostSend(const void* buf, int64_t bytes, int peer,
                                                    int tag) override {
    return root_.PostSend(buf, bytes, members_[static_cast<size_t>(peer)], tag_base_ + tag);
  }
  absl::StatusOr<std::unique_ptr<Request>> PostRecv(void* buf, int64_t bytes, int peer,
                                                    int tag) override {
    return root_.PostRecv(buf, bytes, members_[static_cast<size_t>(peer)], tag_base_ + tag);
  }
  int max_transport_tag() const override { return root_.max_transport_tag(); }

 private:
  PointToPointChannel& root() override { return root_; }
  int RootRank(int r) const override { return members_[static_cast<size_t>(r)]; }

  PointToPointChannel& root_;
  std::vector<int> members_;  // root ranks, by rank here
  int rank_;
  int tag_base_;
};

absl::StatusOr<std::unique_ptr<DataChannel>> PointToPointChannel::Split(int color, int key) {
  PointToPointChannel& transport = root();
  const int n = size();
  const int64_t mine[3] = {color, key, transport.next_split_index_};
  std::vector<int64_t> all(3 * static_cast<size_t>(n));
  if (absl::Status s = Allgather(mine, all.data(), 3, DataType::kInt64); !s.ok()) return s;
  int64_t index = 0;
  std::vector<int> members;  // ranks here of my color
  for (int r = 0; r < n; ++r) {
    const int64_t c = all[3 * static_cast<size_t>(r)];
    if (c < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Split on rank ", rank(), ": rank ", r, " passed color ", c,
          "; every rank must pass a color >= 0 (ranks of one color form a sub-channel)"));
    }
    index = std::max(index, all[3 * static_cast<size_t>(r) + 2]);
    if (c == color) members.push_back(r);
  }
  // Every rank saw the same proposals, so every rank takes the same index.
  transport.next_split_index_ = index + 1;
  const int64_t base = index * kSubChannelTagStride;
  if (base + kSubChannelTagStride - 1 > transport.max_transport_tag()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Split on rank ", rank(), ": sub-channel ", index, " needs tags up to ",
        base + kSubChannelTagStride - 1, " but the ", backend(), " transport accepts at most ",
        transport.max_transport_tag(), "; split fewer times (keep sub-channels for the job)"));
  }
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
    return all[3 * static_cast<size_t>(a) + 1] < all[3 * static_cast<size_t>(b) + 1];
  });
  const int my_rank =
      static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
  std::vector<int> root_ranks;
  root_ranks.reserve(members.size());
  for (const int r : members) root_ranks.push_back(RootRank(r));
  ChannelOptions options;
  options.timeout = timeout();
  return std::make_unique<SubChannel>(transport, std::move(root_ranks), my_rank,
                                      static_cast<int>(base), options);
}

}  // namespace rackrun::comm
