#include "comm/inprocess_channel.h"

#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "comm/p2p_channel.h"

namespace rackrun::comm {
namespace {

struct RecvState {
  void* buf = nullptr;
  int64_t bytes = 0;
  int src = -1;
  int tag = 0;
  bool done = false;
  absl::Status error;
};

struct Message {
  int src = -1;
  int tag = 0;
  std::vector<std::byte> data;
};

// Mailboxes of all ranks behind one mutex: tests move little data, and one lock makes the
// matching rules obviously right.
class Fabric {
 public:
  explicit Fabric(int ranks) : boxes_(static_cast<size_t>(ranks)) {}

  // Delivers to the oldest posted receive with the same (src, tag), or queues.
  void Deliver(int src, int dst, int tag, const void* buf, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    Box& box = boxes_[static_cast<size_t>(dst)];
    for (auto it = box.posted.begin(); it != box.posted.end(); ++it) {
      RecvState& r = **it;
      if (r.src != src || r.tag != tag) continue;
      Complete(r, buf, bytes, dst);
      box.posted.erase(it);
      return;
    }
    Message m{src, tag, std::vector<std::byte>(static_cast<size_t>(bytes))};
    if (bytes > 0) std::memcpy(m.data.data(), buf, static_cast<size_t>(bytes));
    box.unexpected.push_back(std::move(m));
  }

  // Matches the oldest queued message with the same (src, tag), or posts the receive.
  void Post(int dst, const std::shared_ptr<RecvState>& state) {
    std::lock_guard<std::mutex> lock(mu_);
    Box& box = boxes_[static_cast<size_t>(dst)];
    for (auto it = box.unexpected.begin(); it != box.unexpected.end(); ++it) {
      if (it->src != state->src || it->tag != state->tag) continue;
      Complete(*state, it->data.data(), static_cast<int64_t>(it->data.size()), dst);
      box.unexpected.erase(it);
      return;
    }
    box.posted.push_back(state);
  }

  absl::StatusOr<bool> Poll(const RecvState& state) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!state.error.ok()) return state.error;
    return state.done;
  }

  void Cancel(int dst, const std::shared_ptr<RecvState>& state) {
    std::lock_guard<std::mutex> lock(mu_);
    boxes_[static_cast<size_t>(dst)].posted.remove(state);
  }

 private:
  struct Box {
    std::deque<Message> unexpected;
    std::list<std::shared_ptr<RecvState>> posted;
  };

  static void Complete(RecvState& r, const void* buf, int64_t bytes, int dst) {
    if (bytes != r.bytes) {
      r.error = absl::InvalidArgumentError(absl::StrCat(
          "Recv on rank ", dst, " from rank ", r.src, " (tag ", r.tag, "): message has ", bytes,
          " bytes but the receive was posted for ", r.bytes, "; both ends must agree on the size"));
    } else if (bytes > 0) {
      std::memcpy(r.buf, buf, static_cast<size_t>(bytes));
    }
    r.done = true;
  }

  std::mutex mu_;
  std::vector<Box> boxes_ ABSL_GUARDED_BY(mu_);
};

class CompletedSend final : public Request {
 public:
  explicit CompletedSend(const RequestInfo& info) : Request(info) {}
  absl::StatusOr<bool> Test() override { return true; }
};

class InProcessRecv final : public Request {
 public:
  InProcessRecv(const RequestInfo& info, std::shared_ptr<Fabric> fabric,
                std::shared_ptr<RecvState> state)
      : Request(info), fabric_(std::move(fabric)), state_(std::move(state)) {}
  ~InProcessRecv() override { fabric_->Cancel(info().rank, state_); }
  absl::StatusOr<bool> Test() override { return fabric_->Poll(*state_); }

 private:
  std::shared_ptr<Fabric> fabric_;
  std::shared_ptr<RecvState> state_;
};

class InProcessChannel final : public PointToPointChannel {
 public:
  InProcessChannel(std::shared_ptr<Fabric> fabric, int rank, int size,
                   const ChannelOptions& options)
      : PointToPointChannel(options), fabric_(std::move(fabric)), rank_(rank), size_(size) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::string_view backend() const override { return "inprocess"; }

 protected:
  absl::StatusOr<std::unique_ptr<Request>> PostSend(const void* buf, int64_t bytes, int peer,
                                                    int tag) override {
    fabric_->Deliver(rank_, peer, tag, buf, bytes);
    return std::make_unique<CompletedSend>(RequestInfo{true, rank_, size_, peer, tag, bytes});
  }

  absl::StatusOr<std::unique_ptr<Request>> PostRecv(void* buf, int64_t bytes, int peer,
                                                    int tag) override {
    auto state = std::make_shared<RecvState>();
    state->buf = buf;
    state->bytes = bytes;
    state->src = peer;
    state->tag = tag;
    fabric_->Post(rank_, state);
    return std::make_unique<InProcessRecv>(RequestInfo{false, rank_, size_, peer, tag, bytes},
                                           fabric_, std::move(state));
  }

 private:
  std::shared_ptr<Fabric> fabric_;
  int rank_;
  int size_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<DataChannel>>> CreateInProcessChannels(
    int ranks, const ChannelOptions& options) {
  if (ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("in-process channel: ranks=", ranks, "; pass at least 1"));
  }
  auto fabric = std::make_shared<Fabric>(ranks);
  std::vector<std::unique_ptr<DataChannel>> channels;
  for (int r = 0; r < ranks; ++r) {
    channels.push_back(std::make_unique<InProcessChannel>(fabric, r, ranks, options));
  }
  return channels;
}

absl::Status RunInProcessRanks(int ranks, const ChannelOptions& options,
                               const std::function<absl::Status(DataChannel&)>& body) {
  absl::StatusOr<std::vector<std::unique_ptr<DataChannel>>> channels =
      CreateInProcessChannels(ranks, options);
  if (!channels.ok()) return channels.status();
  std::vector<absl::Status> results(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] { results[r] = body(*(*channels)[r]); });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace rackrun::comm
