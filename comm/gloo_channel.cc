#include "comm/gloo_channel.h"

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/signals.h"
#include "comm/data_address.h"
#include "comm/p2p_channel.h"
#include "comm/progress.h"

namespace rackrun::comm {
namespace {

namespace tcp = ::gloo::transport::tcp;

// Every message starts with a fixed-size header on one slot: its size (8 bytes), then the
// payload itself when it fits (kInlineBytes: the planner's load rows, counts, fingerprints),
// so a small message is one Gloo message. A larger payload follows on the next slot, and
// its receive is posted once the header has shown that the sizes agree.
constexpr size_t kInlineBytes = 1024;
constexpr size_t kHeaderBytes = sizeof(int64_t) + kInlineBytes;
bool Inline(int64_t bytes) { return bytes <= static_cast<int64_t>(kInlineBytes); }

// The fixed-size header message: size, then the inline payload (unused bytes are zero).
struct Header {
  int64_t bytes = -1;
  std::byte inline_payload[kInlineBytes] = {};
};
static_assert(sizeof(Header) == kHeaderBytes);
uint64_t HeaderSlot(int tag) { return 2 * static_cast<uint64_t>(tag); }
uint64_t PayloadSlot(int tag) { return 2 * static_cast<uint64_t>(tag) + 1; }

// What a caught Gloo exception says, for a Status message.
std::string ExceptionText(std::exception_ptr e) {
  try {
    std::rethrow_exception(std::move(e));
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

using GlooBuffer = ::gloo::transport::UnboundBuffer;

// A Gloo wait that never needs to time out: waitSend/waitRecv treat an expired timeout as
// fatal for the whole context (they close every pair), and Gloo has no completion test.
// Our timeouts are the channel's, so a long bound suffices here.
constexpr std::chrono::milliseconds kGlooWaitBound = std::chrono::hours(24 * 7);

// One Gloo send or receive, and whether it has completed. Debian's libgloo-dev lacks
// gloo/common/memory.h, which the tcp transport's headers need, so the transport's
// completion counts cannot be read directly: a pooled waiter thread (Waiters below)
// blocks in Gloo's wait for each transfer, publishes the outcome here and notifies the
// transport's completion event, on which the rank's thread blocks while it waits.
class Transfer {
 public:
  enum State { kPending, kDone, kFailed };

  // `completed` must outlive the transfer's Release().
  Transfer(std::unique_ptr<GlooBuffer> buf, bool send, CompletionEvent* completed)
      : buf_(std::move(buf)), send_(send), completed_event_(completed) {}

  GlooBuffer& buf() { return *buf_; }

  State state() {
    std::lock_guard<std::mutex> lock(mu_);
    return state_;
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  // On a waiter thread: blocks until the transfer completes, fails, or is cancelled,
  // publishes the outcome, then destroys the Gloo buffer here. Gloo's buffer destructor
  // spins (yielding) until Gloo's loop thread has let go of the buffer, which it does just
  // after signalling completion; on an oversubscribed host that spin is better done by this
  // thread than by the rank's, which meanwhile carries on or blocks in Release().
  void Wait() {
    State state = kDone;
    std::string error;
    try {
      const bool completed =
          send_ ? buf_->waitSend(nullptr, kGlooWaitBound) : buf_->waitRecv(nullptr, kGlooWaitBound);
      if (!completed) {
        state = kFailed;
        error = "cancelled";
      }
    } catch (...) {
      state = kFailed;
      error = ExceptionText(std::current_exception());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      state_ = state;
      error_ = std::move(error);
      gloo_returned_ = true;
      completed_event_->Notify();  // the transport's event outlives its waiter threads
    }
    buf_.reset();  // the transfer's memory is no longer Gloo's once the wait returned
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    changed_.notify_all();
  }

  // Makes sure Gloo no longer touches the transfer's memory: wakes the waiter if the
  // transfer is still pending and waits until it has destroyed the Gloo buffer (which
  // detaches it from the pair). Returns whether the transfer had completed. Idempotent.
  bool Release() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!gloo_returned_) {
      // The waiter destroys the buffer only after setting gloo_returned_ under this lock.
      if (send_) {
        buf_->abortWaitSend();
      } else {
        buf_->abortWaitRecv();
      }
    }
    changed_.wait(lock, [&] { return released_; });
    return state_ == kDone;
  }

 private:
  std::unique_ptr<GlooBuffer> buf_;  // destroyed by the waiter
  const bool send_;
  CompletionEvent* const completed_event_;
  std::mutex mu_;
  std::condition_variable changed_;
  State state_ = kPending;
  bool gloo_returned_ = false;  // the waiter's Gloo wait has returned
  bool released_ = false;       // ... and the waiter has destroyed the buffer
  std::string error_;
};

// Threads that block in Gloo's waits, one per pending transfer, reused. A transfer is
// always picked up at once (a thread is started when none is idle), so Release() never
// waits for another transfer.
class Waiters {
 public:
  Waiters() = default;
  Waiters(const Waiters&) = delete;
  Waiters& operator=(const Waiters&) = delete;

  // Every watched transfer must be Released before this runs.
  ~Waiters() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  void Watch(std::shared_ptr<Transfer> transfer) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(transfer));
    if (idle_ < queue_.size()) {
      threads_.emplace_back([this] { Run(); });
    } else {
      work_.notify_one();
    }
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ++idle_;
      work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      --idle_;
      if (queue_.empty()) return;  // stopping
      std::shared_ptr<Transfer> transfer = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      transfer->Wait();
      transfer.reset();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable work_;
  std::deque<std::shared_ptr<Transfer>> queue_;
  size_t idle_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Our RendezvousStore as Gloo's store, under `prefix`. Gloo expects failures as
// exceptions; the first Status is kept so the caller can return it unchanged.
class StoreAdapter final : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(RendezvousStore& store, std::string prefix, absl::Duration timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_.Set(prefix_ + key, std::string(data.begin(), data.end())));
  }

  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::vector<std::string>> values = store_.Get({prefix_ + key}, timeout_);
    Check(values.status());
    return std::vector<char>(values->front().begin(), values->front().end());
  }

  void wait(const std::vector<std::string>& keys) override { Wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    Wait(keys, std::min(timeout_, absl::FromChrono(timeout)));
  }

  const absl::Status& error() const { return error_; }

 private:
  void Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const std::string& key : keys) full.push_back(prefix_ + key);
    Check(store_.Get(full, timeout).status());
  }

  void Check(const absl::Status& status) {
    if (status.ok()) return;
    if (error_.ok()) error_ = status;
    throw ::gloo::IoException(std::string(status.message()));
  }

  RendezvousStore& store_;
  std::string prefix_;
  absl::Duration timeout_;
  absl::Status error_;
};

struct SendOp {
  Header header;
  std::shared_ptr<Transfer> header_transfer;
  std::shared_ptr<Transfer> payload_transfer;  // null for an inline message
  bool done = false;
};

struct RecvOp {
  void* buf = nullptr;
  int64_t bytes = 0;  // as posted
  Header header;
  std::shared_ptr<Transfer> header_transfer;
  std::shared_ptr<Transfer> payload_transfer;
  // A message of the wrong size, or one for a cancelled receive, is drained here so the
  // slot's message order stays intact.
  std::vector<std::byte> drain;
  bool header_done = false;
  bool payload_posted = false;
  bool done = false;
  bool cancelled = false;
  absl::Status error;

  // Detaches both transfers from Gloo; true if neither was left incomplete.
  bool Release() {
    bool clean = true;
    if (header_transfer != nullptr) clean = header_transfer->Release() && clean;
    if (payload_transfer != nullptr) clean = payload_transfer->Release() && clean;
    return clean;
  }
};

// A message to this rank itself: matched locally, copied eagerly.
struct SelfRecv {
  void* buf = nullptr;
  int64_t bytes = 0;
  bool done = false;
  absl::Status error;
};

// Everything a channel and its requests share. Used by one thread per rank like the
// channel; Gloo's threads and the waiters touch only the transfers, under their locks.
// Teardown releases every transfer (no wait for a peer: pending waits are cancelled),
// then joins the waiters, closes the pairs and stops the device's thread.
class GlooTransport {
 public:
  GlooTransport(std::shared_ptr<::gloo::transport::Device> device,
                std::shared_ptr<::gloo::rendezvous::Context> context, int rank, int size)
      : device_(std::move(device)), context_(std::move(context)), rank_(rank), size_(size) {}

  ~GlooTransport() {
    for (auto& [key, queue] : unposted_) {
      for (std::shared_ptr<RecvOp>& op : queue) op->Release();
    }
    for (std::shared_ptr<RecvOp>& op : draining_) op->Release();
    unposted_.clear();
    draining_.clear();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const CompletionEvent& completed() const { return completed_; }

  // A Gloo transfer of `bytes` at `data` with `peer` on `slot`, watched by a waiter.
  // May throw a Gloo exception.
  std::shared_ptr<Transfer> Start(bool send, void* data, size_t bytes, int peer, uint64_t slot) {
    auto transfer =
        std::make_shared<Transfer>(context_->createUnboundBuffer(data, bytes), send, &completed_);
    if (send) {
      transfer->buf().send(peer, slot, 0, bytes);
    } else {
      transfer->buf().recv(peer, slot, 0, bytes);
    }
    waiters_.Watch(transfer);
    return transfer;
  }

  // FailedPrecondition once a transfer with `peer` was abandoned.
  absl::Status CheckPeerUsable(absl::string_view operation, int peer) const {
    auto it = abandoned_.find(peer);
    if (it == abandoned_.end()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(operation, " on rank ", rank_, " with rank ",
                                                      peer, ": the connection was closed after ",
                                                      it->second, "; the job must stop"));
  }

  // Gloo cannot cancel a transfer that has started, and a pair with an orphaned transfer
  // would stall: close the connection so that neither side waits on it, and refuse
  // further transfers with the peer.
  void Abandon(int peer, absl::string_view why) {
    if (abandoned_.contains(peer)) return;
    abandoned_[peer] = std::string(why);
    try {
      context_->getPair(peer)->close();
    } catch (...) {
      // Closed already by an error; nothing else to release.
    }
  }

  void Enqueue(int peer, int tag, std::shared_ptr<RecvOp> op) {
    unposted_[{peer, tag}].push_back(std::move(op));
  }

  // Posts the payload receives of (peer, tag) whose headers have arrived, oldest first:
  // Gloo matches a slot's messages in posting order, so payloads must be posted in the
  // order of their headers. A failed header is returned as its Gloo error text.
  // May throw a Gloo exception.
  absl::StatusOr<bool> Advance(int peer, int tag) {
    auto it = unposted_.find({peer, tag});
    if (it == unposted_.end()) return true;
    std::deque<std::shared_ptr<RecvOp>>& queue = it->second;
    while (!queue.empty()) {
      RecvOp& op = *queue.front();
      if (!op.header_done) {
        const Transfer::State state = op.header_transfer->state();
        if (state == Transfer::kPending) break;
        if (state == Transfer::kFailed) {
          return Failure("Recv", peer, tag, op.header_transfer->error());
        }
        op.header_done = true;
      }
      const int64_t incoming = std::max<int64_t>(op.header.bytes, 0);
      void* target = op.buf;
      if (op.cancelled || incoming != op.bytes) {
        if (!op.cancelled) {
          op.error = absl::InvalidArgumentError(absl::StrCat(
              "Recv on rank ", rank_, " from rank ", peer, " (tag ", tag, "): message has ",
              op.header.bytes, " bytes but the receive was posted for ", op.bytes,
              "; both ends must agree on the size"));
        }
        if (Inline(incoming)) {  // nothing follows the header: the message is consumed
          op.payload_posted = true;
          queue.pop_front();
          continue;
        }
        op.drain.resize(static_cast<size_t>(incoming));
        target = op.drain.data();
        draining_.push_back(queue.front());
      }
      if (!Inline(incoming)) {
        op.payload_transfer =
            Start(/*send=*/false, target, static_cast<size_t>(incoming), peer, PayloadSlot(tag));
      } else if (incoming > 0) {
        std::memcpy(target, op.header.inline_payload, static_cast<size_t>(incoming));
      }
      op.payload_posted = true;
      queue.pop_front();
    }
    if (queue.empty()) unposted_.erase(it);
    return true;
  }

  void SendToSelf(int tag, const void* buf, int64_t bytes) {
    std::deque<std::shared_ptr<SelfRecv>>& waiting = self_recvs_[tag];
    if (!waiting.empty()) {
      Deliver(*waiting.front(), tag, buf, bytes);
      waiting.pop_front();
      return;
    }
    std::vector<std::byte> copy(static_cast<size_t>(bytes));
    if (bytes > 0) std::memcpy(copy.data(), buf, static_cast<size_t>(bytes));
    self_messages_[tag].push_back(std::move(copy));
  }

  void RecvFromSelf(int tag, const std::shared_ptr<SelfRecv>& recv) {
    std::deque<std::vector<std::byte>>& messages = self_messages_[tag];
    if (!messages.empty()) {
      Deliver(*recv, tag, messages.front().data(), static_cast<int64_t>(messages.front().size()));
      messages.pop_front();
      return;
    }
    self_recvs_[tag].push_back(recv);
  }

  void CancelSelfRecv(int tag, const std::shared_ptr<SelfRecv>& recv) {
    std::deque<std::shared_ptr<SelfRecv>>& waiting = self_recvs_[tag];
    waiting.erase(std::remove(waiting.begin(), waiting.end(), recv), waiting.end());
  }

  // A failed Gloo call as a Status naming the operation, this rank and the peer.
  absl::Status Failure(absl::string_view operation, int peer, int tag,
                       absl::string_view gloo_error) const {
    return absl::UnavailableError(absl::StrCat(
        operation, " on rank ", rank_, " of ", size_, " with rank ", peer, " (tag ", tag,
        "): Gloo: ", gloo_error, "; that rank died, closed its channel, or the network failed"));
  }

 private:
  void Deliver(SelfRecv& recv, int tag, const void* buf, int64_t bytes) {
    if (bytes != recv.bytes) {
      recv.error = absl::InvalidArgumentError(
          absl::StrCat("Recv on rank ", rank_, " from rank ", rank_, " (tag ", tag,
                       "): message has ", bytes, " bytes but the receive was posted for ",
                       recv.bytes, "; both ends must agree on the size"));
    } else if (bytes > 0) {
      std::memcpy(recv.buf, buf, static_cast<size_t>(bytes));
    }
    recv.done = true;
  }

  // Destroyed bottom-up: the waiters (all transfers released by then), the pairs, the
  // device's thread.
  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::rendezvous::Context> context_;
  int rank_;
  int size_;
  CompletionEvent completed_;  // outlives the waiters, which notify it
  Waiters waiters_;
  std::map<int, std::string> abandoned_;  // peer -> why
  // Receives whose payload is not posted yet, by (peer, tag), oldest first.
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<RecvOp>>> unposted_;
  // Receives draining a message nobody will read; kept until the channel goes.
  std::vector<std::shared_ptr<RecvOp>> draining_;
  std::map<int, std::deque<std::vector<std::byte>>> self_messages_;
  std::map<int, std::deque<std::shared_ptr<SelfRecv>>> self_recvs_;
};

class GlooSend final : public Request {
 public:
  GlooSend(const RequestInfo& info, std::shared_ptr<GlooTransport> transport,
           std::unique_ptr<SendOp> op)
      : Request(info), transport_(std::move(transport)), op_(std::move(op)) {}

  ~GlooSend() override {
    if (op_ == nullptr) return;
    bool clean = op_->header_transfer->Release();
    if (op_->payload_transfer != nullptr) clean = op_->payload_transfer->Release() && clean;
    if (!clean) {
      transport_->Abandon(info().peer, absl::StrCat("a send (tag ", info().tag,
                                                    ") was abandoned before it completed"));
    }
  }

  const CompletionEvent* completion_event() const override { return &transport_->completed(); }

  absl::StatusOr<bool> Test() override {
    if (op_ == nullptr || op_->done) return true;
    for (Transfer* t : {op_->header_transfer.get(), op_->payload_transfer.get()}) {
      if (t == nullptr) continue;
      const Transfer::State state = t->state();
      if (state == Transfer::kPending) return false;
      if (state == Transfer::kFailed) {
        return transport_->Failure("Send", info().peer, info().tag, t->error());
      }
    }
    op_->done = true;
    return true;
  }

 private:
  std::shared_ptr<GlooTransport> transport_;
  std::unique_ptr<SendOp> op_;  // null for a message to self (completed at once)
};

class GlooRecv final : public Request {
 public:
  GlooRecv(const RequestInfo& info, std::shared_ptr<GlooTransport> transport,
           std::shared_ptr<RecvOp> op)
      : Request(info), transport_(std::move(transport)), op_(std::move(op)) {}

  ~GlooRecv() override {
    if (op_->done || !op_->error.ok()) return;
    if (!op_->payload_posted) {
      // Not started: its message will be drained when it arrives.
      op_->cancelled = true;
      return;
    }
    if (!op_->Release()) {
      transport_->Abandon(info().peer, absl::StrCat("a receive (tag ", info().tag,
                                                    ") was abandoned before it completed"));
    }
  }

  const CompletionEvent* completion_event() const override { return &transport_->completed(); }

  absl::StatusOr<bool> Test() override {
    if (op_->done) return true;
    if (!op_->error.ok()) return op_->error;
    try {
      absl::StatusOr<bool> advanced = transport_->Advance(info().peer, info().tag);
      if (!advanced.ok()) return advanced.status();
    } catch (...) {
      return transport_->Failure("Recv", info().peer, info().tag,
                                 ExceptionText(std::current_exception()));
    }
    if (!op_->error.ok()) return op_->error;
    if (!op_->payload_posted) return false;
    if (op_->payload_transfer != nullptr) {
      const Transfer::State state = op_->payload_transfer->state();
      if (state == Transfer::kPending) return false;
      if (state == Transfer::kFailed) {
        return transport_->Failure("Recv", info().peer, info().tag, op_->payload_transfer->error());
      }
    }
    op_->done = true;
    return true;
  }

 private:
  std::shared_ptr<GlooTransport> transport_;
  std::shared_ptr<RecvOp> op_;
};

class SelfRecvRequest final : public Request {
 public:
  SelfRecvRequest(const RequestInfo& info, std::shared_ptr<GlooTransport> transport,
                  std::shared_ptr<SelfRecv> recv)
      : Request(info), transport_(std::move(transport)), recv_(std::move(recv)) {}
  ~SelfRecvRequest() override {
    if (!recv_->done) transport_->CancelSelfRecv(info().tag, recv_);
  }
  // Completes when this thread posts the matching send, never while it waits; it reports
  // the transport's event so that a wait over a whole collective's requests still blocks.
  const CompletionEvent* completion_event() const override { return &transport_->completed(); }

  absl::StatusOr<bool> Test() override {
    if (!recv_->error.ok()) return recv_->error;
    return recv_->done;
  }

 private:
  std::shared_ptr<GlooTransport> transport_;
  std::shared_ptr<SelfRecv> recv_;
};

class GlooChannel final : public PointToPointChannel {
 public:
  GlooChannel(std::shared_ptr<GlooTransport> transport, const ChannelOptions& options)
      : PointToPointChannel(options), transport_(std::move(transport)) {}

  int rank() const override { return transport_->rank(); }
  int size() const override { return transport_->size(); }
  absl::string_view backend() const override { return "gloo"; }
  const CompletionEvent* completion_event() const override { return &transport_->completed(); }

 protected:
  absl::StatusOr<std::unique_ptr<Request>> PostSend(const void* buf, int64_t bytes, int peer,
                                                    int tag) override {
    const RequestInfo info{true, rank(), size(), peer, tag, bytes};
    if (peer == rank()) {
      transport_->SendToSelf(tag, buf, bytes);
      return std::make_unique<GlooSend>(info, transport_, nullptr);
    }
    if (absl::Status s = transport_->CheckPeerUsable("Send", peer); !s.ok()) return s;
    auto op = std::make_unique<SendOp>();
    op->header.bytes = bytes;
    if (Inline(bytes) && bytes > 0) {
      std::memcpy(op->header.inline_payload, buf, static_cast<size_t>(bytes));
    }
    try {
      op->header_transfer =
          transport_->Start(/*send=*/true, &op->header, kHeaderBytes, peer, HeaderSlot(tag));
      if (!Inline(bytes)) {
        op->payload_transfer =
            transport_->Start(/*send=*/true, const_cast<void*>(buf), static_cast<size_t>(bytes),
                              peer, PayloadSlot(tag));
      }
    } catch (...) {
      const std::string what = ExceptionText(std::current_exception());
      if (op->header_transfer != nullptr) op->header_transfer->Release();
      return transport_->Failure("Send", peer, tag, what);
    }
    return std::make_unique<GlooSend>(info, transport_, std::move(op));
  }

  absl::StatusOr<std::unique_ptr<Request>> PostRecv(void* buf, int64_t bytes, int peer,
                                                    int tag) override {
    const RequestInfo info{false, rank(), size(), peer, tag, bytes};
    if (peer == rank()) {
      auto recv = std::make_shared<SelfRecv>();
      recv->buf = buf;
      recv->bytes = bytes;
      transport_->RecvFromSelf(tag, recv);
      return std::make_unique<SelfRecvRequest>(info, transport_, std::move(recv));
    }
    if (absl::Status s = transport_->CheckPeerUsable("Recv", peer); !s.ok()) return s;
    auto op = std::make_shared<RecvOp>();
    op->buf = buf;
    op->bytes = bytes;
    try {
      op->header_transfer =
          transport_->Start(/*send=*/false, &op->header, kHeaderBytes, peer, HeaderSlot(tag));
    } catch (...) {
      return transport_->Failure("Recv", peer, tag, ExceptionText(std::current_exception()));
    }
    transport_->Enqueue(peer, tag, op);
    return std::make_unique<GlooRecv>(info, transport_, std::move(op));
  }

 private:
  std::shared_ptr<GlooTransport> transport_;
};

std::string JoinedKey(const std::string& prefix, int rank) {
  return absl::StrCat(prefix, "/gloo/joined/", rank);
}

// Announces this rank under `prefix` (the value says who it is: `announced`, the address
// and label its peers are told) and waits for all ranks; DeadlineExceeded names the ranks
// that did not join.
absl::Status Join(RendezvousStore& store, const std::string& prefix, int rank, int size,
                  const std::string& announced, absl::Duration timeout) {
  auto key = [&](int r) { return JoinedKey(prefix, r); };
  if (absl::Status s = store.Set(key(rank), announced); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("Gloo channel '", prefix, "' on rank ", rank,
                                               ": announcing this rank: ", s.message()));
  }
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key(r));
  absl::Status s = store.Get(keys, timeout).status();
  if (s.ok()) return s;
  if (s.code() != absl::StatusCode::kDeadlineExceeded) {
    return absl::Status(s.code(), absl::StrCat("Gloo channel '", prefix, "' on rank ", rank,
                                               ": waiting for the other ranks: ", s.message()));
  }
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    if (!store.Get({key(r)}, absl::ZeroDuration()).ok()) missing.push_back(r);
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "Gloo channel '", prefix, "' on rank ", rank, " of ", size, ": rank",
      missing.size() > 1 ? "s " : " ", absl::StrJoin(missing, ", "), " did not join within ",
      absl::FormatDuration(timeout), "; they are dead, stuck, or not creating this channel"));
}

// The peers as they announced themselves ("rank R at ADDRESS (LABEL)"): those this host
// has no route to, and the others.
struct Peers {
  std::vector<std::string> unroutable, others;
};
Peers PeersAnnounced(RendezvousStore& store, const std::string& prefix, int rank, int size) {
  Peers p;
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    absl::StatusOr<std::vector<std::string>> v =
        store.Get({JoinedKey(prefix, r)}, absl::ZeroDuration());
    if (!v.ok() || v->empty()) continue;
    const std::string& announced = v->front();
    const std::string address = announced.substr(0, announced.find(' '));
    const std::string line = absl::StrCat("rank ", r, " at ", announced);
    (Routable(address) ? p.others : p.unroutable).push_back(line);
  }
  return p;
}

// For a failed connect: the peers, those this host has no route to first.
std::string PeersLine(const Peers& p) {
  if (!p.unroutable.empty()) return absl::StrCat("; ", NoRoute(p.unroutable));
  if (p.others.empty()) return "";
  return absl::StrCat("; the peers announced: ", absl::StrJoin(p.others, ", "));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataChannel>> CreateGlooChannel(RendezvousStore& store,
                                                               const std::string& prefix, int rank,
                                                               int size,
                                                               const GlooChannelOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("Gloo channel '", prefix, "': rank ", rank,
                                                   " of size ", size,
                                                   " is not a rank in [0, size) of size >= 1"));
  }
  // Gloo binds the listener to the address it is given (after resolving a name), so a
  // wildcard would listen on every interface and announce an address no peer can reach.
  if (options.interface.empty() && IsWildcardAddress(options.address)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gloo channel '", prefix, "' on rank ", rank, ": address '", options.address,
        "' is every interface; give the one address peers reach this rank on (the worker's "
        "--data-address)"));
  }
  const absl::Time deadline = absl::Now() + options.channel.timeout;
  // Gloo writes to its sockets without MSG_NOSIGNAL: a write to a dead peer would raise
  // SIGPIPE and kill this process instead of failing the transfer.
  base::IgnoreSigpipe();
  const std::string announced = Announced(options.address, options.label);
  if (absl::Status s = Join(store, prefix, rank, size, announced, options.channel.timeout);
      !s.ok()) {
    return s;
  }

  // Which side of a pair connects depends on the ports, so a peer's address this host
  // cannot reach fails here, the same way every time, naming that peer. A misconfigured
  // address, not a transient fault: InvalidArgument, reported at once (a worker waits for
  // the coordinator's verdict after an Unavailable, which nobody else would give here).
  if (const Peers peers = PeersAnnounced(store, prefix, rank, size); !peers.unroutable.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("Gloo channel '", prefix, "' on rank ", rank,
                                                   " of ", size, ": ", NoRoute(peers.unroutable)));
  }

  tcp::attr attr;
  attr.hostname = options.address;
  attr.iface = options.interface;
  std::shared_ptr<::gloo::transport::Device> device;
  try {
    device = tcp::CreateDevice(attr);
  } catch (...) {
    return absl::UnavailableError(absl::StrCat(
        "Gloo channel '", prefix, "' on rank ", rank, ": cannot listen on ",
        options.interface.empty() ? "address " + options.address : "interface " + options.interface,
        ": ", ExceptionText(std::current_exception())));
  }

  // Every rank has joined, so connecting takes moments; Gloo waits up to 5x its timeout
  // for a pair to connect, hence a fifth of what is left.
  const absl::Duration left = std::max(deadline - absl::Now(), absl::Milliseconds(500));
  auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  context->setTimeout(absl::ToChronoMilliseconds(left / 5));
  StoreAdapter gloo_store(store, absl::StrCat(prefix, "/gloo/mesh/"), left);
  try {
    context->connectFullMesh(gloo_store, device);
  } catch (...) {
    const std::string what = ExceptionText(std::current_exception());
    const absl::Status& store_error = gloo_store.error();
    return absl::Status(store_error.ok() ? absl::StatusCode::kUnavailable : store_error.code(),
                        absl::StrCat("Gloo channel '", prefix, "' on rank ", rank, " of ", size,
                                     ": connecting to the other ranks failed: ",
                                     store_error.ok() ? what : std::string(store_error.message()),
                                     "; a rank died or is unreachable at the address it announced",
                                     PeersLine(PeersAnnounced(store, prefix, rank, size))));
  }
  auto transport = std::make_shared<GlooTransport>(device, std::move(context), rank, size);
  return std::make_unique<GlooChannel>(std::move(transport), options.channel);
}

}  // namespace rackrun::comm
