#include "comm/ucx_channel.h"

#include <sys/stat.h>
#include <ucp/api/ucp.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "comm/data_address.h"
#include "comm/p2p_channel.h"
#include "comm/progress.h"

namespace rackrun::comm {
namespace {

// A message's UCP tag: the sender's rank in the high half, the channel tag (>= 0, below
// 2^31) in the low half; receives match all 64 bits.
ucp_tag_t WireTag(int source, int tag) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(source)) << 32) |
         static_cast<uint64_t>(static_cast<uint32_t>(tag));
}
constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};
// The closing handshake's "bye" from `source`: the low half is no channel tag (those are
// below 2^31), so no receive of the channel's users ever matches it.
ucp_tag_t ByeTag(int source) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(source)) << 32) | uint64_t{0xffffffffu};
}

std::string UcsText(ucs_status_t status) { return ucs_status_string(status); }

// How often a rank that waits drives its watch worker (UcxTransport::Progress): each pass
// polls the watch endpoints' TCP sockets, a system call or more, so not on every pass.
constexpr std::chrono::steady_clock::duration kWatchPeriod = std::chrono::milliseconds(1);
// How long teardown drives the worker to let closed endpoints, cancelled receives and
// this rank's byes finish (the wait for the peers' byes is bounded by the channel's timeout).
constexpr absl::Duration kTeardownBound = absl::Seconds(1);
// How long an endpoint's creation is retried while UCX reports the peer unreachable. The
// route to every peer is checked before (comm/data_address.h), so what is left is most
// likely the neighbour table of a host whose link has just come back: once, under load, a
// restored host's first job failed at once with connect(2) EHOSTUNREACH to a peer on its own
// subnet (NetnsTest.ACutHostIsNamedAndTheJobRestartsOnASpareHost in CI); not reproduced
// alone, so the cause is a guess. Linux resolves a neighbour in 3 probes a second apart.
constexpr absl::Duration kUnreachableRetry = absl::Seconds(4);
constexpr absl::Duration kUnreachablePause = absl::Milliseconds(200);
// UCX settings this channel changes from UCX's defaults; the environment's UCX_<name> wins.
struct UcxDefault {
  const char* name;
  const char* value;
  bool shared_memory = false;  // a shared-memory transport's: not for the TCP-only watch context
};
constexpr UcxDefault kUcxDefaults[] = {
    // How soon a dead peer reached over shared memory is noticed (UCX's default is 20 s).
    {"KEEPALIVE_INTERVAL", "1s"},
    // No rendezvous lanes: large messages go through the endpoint's active-message
    // pipeline instead of zero-copy reads of the peer's memory (CMA on one host), which
    // abort this process when the peer dies mid-transfer
    // (PeerProcessKilledMidTransferFailsTheSurvivor).
    {"MAX_RNDV_RAILS", "0"},
    // Shared memory's copy-out segments: 32 KiB of payload (UCX's default is 8 KiB) and
    // eager sends up to 1 MiB. Without lanes, a rendezvous costs a handshake and then
    // moves its data through the same segments as an eager send, so 64 KiB-1 MiB messages
    // took 1.5-2.9x Open MPI's time (bench_channel_bench, comm/README.md); with these (and
    // the watch worker) 0.7-1.4x at 2 ranks. Larger segments broke UCX 1.13 (payload
    // lengths over 64 KiB arrive as 0 bytes); messages above 1 MiB still wait for their
    // receive (no unbounded eager buffering of a late receiver).
    {"MM_SEG_SIZE", "32832", /*shared_memory=*/true},
    {"RNDV_THRESH", "1m"},
};

// One channel's UCP contexts, workers and endpoints: the data context and worker (every
// transport UCX offers) and, for peers on this machine, a watch context and worker (TCP
// only) whose endpoints carry nothing but failure detection (Connect says why). Used only
// by the rank's thread (both workers are single-threaded): UCX calls the endpoint error
// handler from within ucp_worker_progress on that thread. Requests share it, so it
// outlives them.
class UcxTransport {
 public:
  UcxTransport(int rank, int size) : rank_(rank), size_(size), failed_(static_cast<size_t>(size)) {}
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  ~UcxTransport() {
    CloseEndpoints(std::vector<bool>(static_cast<size_t>(size_), false));
    // The byes never received (peers that died or never closed) are cancelled.
    for (void*& request : bye_recvs_) {
      if (request == nullptr) continue;
      ucp_request_cancel(worker_, request);
      const absl::Time until = absl::Now() + kTeardownBound;
      while (ucp_request_check_status(request) == UCS_INPROGRESS && absl::Now() < until) {
        ucp_worker_progress(worker_);
      }
      ucp_request_free(request);
      request = nullptr;
    }
    if (watch_worker_ != nullptr) ucp_worker_destroy(watch_worker_);
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (watch_context_ != nullptr) ucp_cleanup(watch_context_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  // The closing handshake, once, when the channel is destroyed (requests may outlive it):
  // a bye to every peer, sent after everything this rank sent it, then, while
  // `wait_for_peers`, waiting (bounded by `bound`) until every peer's bye has arrived or
  // that peer failed. A peer's bye arrives after all its messages, and a peer sends it only
  // when it closes, so once both byes are through nothing either rank sent the other is
  // still on its way, and the endpoint may close in flush mode. Otherwise (a peer dead,
  // silent, or `wait_for_peers` false: the channel is broken anyway) only this rank's byes
  // get up to kTeardownBound, and the endpoints to peers whose bye did not come are closed
  // forcibly, so closing never hangs.
  void Close(bool wait_for_peers, absl::Duration bound) {
    if (closed_) return;
    closed_ = true;
    const size_t n = static_cast<size_t>(size_);
    std::vector<void*> byes(n, nullptr);
    std::vector<bool> bye_sent(n, false);
    static const char kBye = 0;
    for (int peer = 0; peer < size_; ++peer) {
      const size_t p = static_cast<size_t>(peer);
      if (peer == rank_ || eps_.empty() || eps_[p] == nullptr || !failed_[p].empty()) continue;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
      param.datatype = ucp_dt_make_contig(1);
      ucs_status_ptr_t request = ucp_tag_send_nbx(eps_[p], &kBye, 1, ByeTag(rank_), &param);
      if (UCS_PTR_IS_ERR(request)) continue;
      byes[p] = request;
      bye_sent[p] = request == nullptr;
    }
    const absl::Time start = absl::Now();
    const absl::Time peers_until = start + (wait_for_peers ? bound : absl::ZeroDuration());
    const absl::Time own_until = std::max(peers_until, start + kTeardownBound);
    ProgressBackoff backoff;
    std::vector<bool> done(n, false);
    while (true) {
      const bool progressed = Progress();
      bool own_done = true, peers_done = true;
      for (int peer = 0; peer < size_; ++peer) {
        const size_t p = static_cast<size_t>(peer);
        if (peer == rank_) continue;
        const bool failed = !failed_[p].empty();
        if (byes[p] != nullptr && !bye_sent[p]) {
          const ucs_status_t s = ucp_request_check_status(byes[p]);
          if (s != UCS_INPROGRESS)
            bye_sent[p] = s == UCS_OK;
          else if (!failed)
            own_done = false;
        }
        if (!PeerClosed(peer) && !failed) peers_done = false;
        done[p] = bye_sent[p] && PeerClosed(peer) && !failed;
      }
      const absl::Time now = absl::Now();
      if (own_done && (peers_done || now >= peers_until)) break;
      if (now >= own_until) break;
      if (progressed) {
        backoff.Progress();
      } else {
        backoff.Idle(own_until);
      }
    }
    for (void* request : byes) {
      if (request != nullptr) ucp_request_free(request);
    }
    done[static_cast<size_t>(rank_)] = true;  // the loopback endpoint
    CloseEndpoints(done);
  }

  // The data and watch contexts and workers, UCX's network transports on `net_devices`
  // unless empty; Unavailable naming the UCX call on failure.
  absl::Status Init(const std::string& prefix, const std::string& net_devices) {
    if (absl::Status s =
            CreateWorker(prefix, net_devices, /*watch=*/false, &context_, &worker_, &address_);
        !s.ok()) {
      return s;
    }
    return CreateWorker(prefix, net_devices, /*watch=*/true, &watch_context_, &watch_worker_,
                        &watch_address_);
  }

  // This rank's data and watch workers' addresses, as the peers need them.
  const std::string& address() const { return address_; }
  const std::string& watch_address() const { return watch_address_; }

  // Endpoints to every rank, this one included, from the ranks' published data and watch
  // worker addresses; `same_host[r]`: rank r runs on this machine (same boot id and
  // network namespace).
  //
  // UCX 1.13 offers peer failure handling only on transports that can detect it (TCP,
  // verbs), not on shared memory: an endpoint that asks for it carries every message over
  // TCP, even to a rank on this machine. So a rank on this machine gets two endpoints:
  // the data endpoint without error handling, which UCX puts on shared memory, and a watch
  // endpoint with it, over which nothing is sent and whose TCP connection and keepalive
  // report the peer's death or closed channel. A rank on another machine gets one
  // endpoint with error handling (TCP or verbs), which does both.
  //
  // The watch endpoints live on their own worker (a TCP-only context), between the
  // ranks' watch workers: a worker with a TCP endpoint polls its sockets on every
  // progress call, which made every shared-memory message on the data worker 3x slower
  // (8-byte ping-pong 6.9 against 2.0 us, comm/README.md). Progress() drives the watch
  // worker every kWatchPeriod.
  absl::Status Connect(const std::string& prefix, const std::vector<std::string>& addresses,
                       const std::vector<std::string>& watch_addresses,
                       const std::vector<bool>& same_host) {
    const size_t n = static_cast<size_t>(size_);
    eps_.assign(n, nullptr);
    watch_eps_.assign(n, nullptr);
    handlers_.resize(n);
    for (int peer = 0; peer < size_; ++peer) {
      const size_t p = static_cast<size_t>(peer);
      handlers_[p] = ErrorHandlerArg{this, peer};
      const auto* address = reinterpret_cast<const ucp_address_t*>(addresses[p].data());
      const bool local = same_host[p] || peer == rank_;
      ucs_status_t s =
          CreateEndpoint(worker_, address, /*handle_errors=*/!local, &handlers_[p], &eps_[p]);
      if (s == UCS_OK && local && peer != rank_) {
        const auto* watch = reinterpret_cast<const ucp_address_t*>(watch_addresses[p].data());
        s = CreateEndpoint(watch_worker_, watch, /*handle_errors=*/true, &handlers_[p],
                           &watch_eps_[p]);
      }
      if (s != UCS_OK) {
        return absl::UnavailableError(absl::StrCat(
            "UCX channel '", prefix, "' on rank ", rank_, " of ", size_, ": connecting to rank ",
            peer, At(peer), " failed (ucp_ep_create: ", UcsText(s),
            "); that rank is unreachable at the address it published"));
      }
    }
    // Every peer's bye is awaited from the start, so that a receive from a peer that has
    // closed can be told apart from one still to come.
    bye_recvs_.assign(n, nullptr);
    bye_buffers_.assign(n, 0);
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      param.datatype = ucp_dt_make_contig(1);
      ucs_status_ptr_t request = ucp_tag_recv_nbx(worker_, &bye_buffers_[static_cast<size_t>(peer)],
                                                  1, ByeTag(peer), kFullMask, &param);
      if (UCS_PTR_IS_ERR(request)) {
        return absl::UnavailableError(
            absl::StrCat("UCX channel '", prefix, "' on rank ", rank_, " of ", size_,
                         ": posting the receive of rank ", peer,
                         "'s closing message failed: ", UcsText(UCS_PTR_STATUS(request))));
      }
      bye_recvs_[static_cast<size_t>(peer)] = request;
    }
    return absl::OkStatus();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  ucp_worker_h worker() const { return worker_; }
  ucp_ep_h ep(int peer) const { return eps_[static_cast<size_t>(peer)]; }
  // Drives the data worker, and the watch worker when kWatchPeriod has passed since it was
  // last driven; true if the data worker made progress.
  bool Progress() {
    const bool progressed = ucp_worker_progress(worker_) != 0;
    const auto now = std::chrono::steady_clock::now();
    if (now - watched_ >= kWatchPeriod) {
      watched_ = now;
      while (ucp_worker_progress(watch_worker_) != 0) {
      }
    }
    return progressed;
  }

  // True once `peer`'s bye has arrived: it closed its channel, and every message it sent
  // this rank has arrived (matched a receive, or waits for one).
  bool PeerClosed(int peer) {
    void* request = bye_recvs_.empty() ? nullptr : bye_recvs_[static_cast<size_t>(peer)];
    return request != nullptr && ucp_request_check_status(request) != UCS_INPROGRESS;
  }

  // Why transfers with `peer` cannot go on (empty while they can).
  const std::string& failure(int peer) const { return failed_[static_cast<size_t>(peer)]; }
  // After a receive could not be cancelled: nothing more with that peer is defined.
  void Abandon(int peer, std::string why) {
    std::string& f = failed_[static_cast<size_t>(peer)];
    if (f.empty()) f = std::move(why);
  }

  // A failed transfer as a Status naming the operation, this rank and the peer (with
  // where it announced itself to be).
  absl::Status Failure(absl::string_view operation, int peer, int tag,
                       absl::string_view why) const {
    return absl::UnavailableError(absl::StrCat(
        operation, " on rank ", rank_, " of ", size_, " with rank ", peer, At(peer), " (tag ", tag,
        "): UCX: ", why, "; that rank died, closed its channel, or the network failed"));
  }

  // The peers as they announced themselves (Whereabouts::Describe), by rank.
  void set_peers(std::vector<std::string> peers) { peers_ = std::move(peers); }

 private:
  struct ErrorHandlerArg {
    UcxTransport* transport = nullptr;
    int peer = -1;
  };

  // " at ADDRESS (LABEL)" for a peer whose whereabouts are known, else "".
  std::string At(int peer) const {
    const size_t p = static_cast<size_t>(peer);
    return p < peers_.size() ? absl::StrCat(" at ", peers_[p]) : std::string();
  }

  // One context (kUcxDefaults applied; the watch context on TCP only) and its worker.
  absl::Status CreateWorker(const std::string& prefix, const std::string& net_devices, bool watch,
                            ucp_context_h* context, ucp_worker_h* worker, std::string* address) {
    const auto failed = [&](absl::string_view call, ucs_status_t status) {
      return absl::UnavailableError(absl::StrCat("UCX channel '", prefix, "' on rank ", rank_, ": ",
                                                 call, watch ? " (watch worker)" : "",
                                                 " failed: ", UcsText(status)));
    };
    ucp_config_t* config = nullptr;
    if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
      return failed("ucp_config_read", s);
    }
    const auto modify = [&](const char* name, const char* value) {
      return ucp_config_modify(config, name, value);
    };
    for (const UcxDefault& setting : kUcxDefaults) {
      // A setting no transport of the context reads makes UCX warn "invalid configuration".
      if (watch && setting.shared_memory) continue;
      if (std::getenv(absl::StrCat("UCX_", setting.name).c_str()) != nullptr) continue;
      if (ucs_status_t s = modify(setting.name, setting.value); s != UCS_OK) {
        ucp_config_release(config);
        return failed(absl::StrCat("ucp_config_modify(", setting.name, ")"), s);
      }
    }
    if (watch) {
      // Whatever UCX_TLS says: the watch endpoints exist for TCP's failure detection.
      if (ucs_status_t s = modify("TLS", "tcp"); s != UCS_OK) {
        ucp_config_release(config);
        return failed("ucp_config_modify(TLS)", s);
      }
    }
    if (!net_devices.empty() && std::getenv("UCX_NET_DEVICES") == nullptr) {
      if (ucs_status_t s = modify("NET_DEVICES", net_devices.c_str()); s != UCS_OK) {
        ucp_config_release(config);
        return failed("ucp_config_modify(NET_DEVICES)", s);
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_TAG;
    params.mt_workers_shared = 0;
    ucs_status_t s = ucp_init(&params, config, context);
    ucp_config_release(config);
    if (s != UCS_OK) return failed("ucp_init", s);
    ucp_worker_params_t worker_params{};
    worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (s = ucp_worker_create(*context, &worker_params, worker); s != UCS_OK) {
      return failed("ucp_worker_create", s);
    }
    ucp_address_t* own = nullptr;
    size_t length = 0;
    if (s = ucp_worker_get_address(*worker, &own, &length); s != UCS_OK) {
      return failed("ucp_worker_get_address", s);
    }
    address->assign(reinterpret_cast<const char*>(own), length);
    ucp_worker_release_address(*worker, own);
    return absl::OkStatus();
  }

  ucs_status_t CreateEndpoint(ucp_worker_h worker, const ucp_address_t* address, bool handle_errors,
                              ErrorHandlerArg* handler, ucp_ep_h* ep) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.address = address;
    params.err_mode = handle_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (handle_errors) {
      params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.err_handler.cb = &UcxTransport::OnPeerError;
      params.err_handler.arg = handler;
    }
    const absl::Time until = absl::Now() + kUnreachableRetry;
    ucs_status_t s = ucp_ep_create(worker, &params, ep);
    while (s == UCS_ERR_UNREACHABLE && absl::Now() < until) {
      absl::SleepFor(kUnreachablePause);
      s = ucp_ep_create(worker, &params, ep);
    }
    if (s != UCS_OK) *ep = nullptr;
    return s;
  }

  // Closes every endpoint still open: in flush mode to the peers marked `flush`, forcibly
  // to the others; waits at most kTeardownBound for them together.
  void CloseEndpoints(const std::vector<bool>& flush) {
    std::vector<void*> closing;
    for (std::vector<ucp_ep_h>* list : {&eps_, &watch_eps_}) {
      for (size_t p = 0; p < list->size(); ++p) {
        ucp_ep_h& ep = (*list)[p];
        if (ep == nullptr) continue;
        ucp_request_param_t param{};
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = flush[p] ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
        ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
        if (request != nullptr && !UCS_PTR_IS_ERR(request)) closing.push_back(request);
        ep = nullptr;
      }
    }
    const absl::Time until = absl::Now() + kTeardownBound;
    for (void* request : closing) {
      while (ucp_request_check_status(request) == UCS_INPROGRESS && absl::Now() < until) {
        ucp_worker_progress(worker_);
        ucp_worker_progress(watch_worker_);
      }
      ucp_request_free(request);
    }
  }

  // Called by UCX from ucp_worker_progress (this rank's thread) when the endpoint to a
  // peer fails: pending sends to it fail on their own, receives from it check failure().
  static void OnPeerError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    auto* handler = static_cast<ErrorHandlerArg*>(arg);
    handler->transport->Abandon(handler->peer,
                                absl::StrCat("the connection failed (", UcsText(status), ")"));
  }

  int rank_;
  int size_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  ucp_context_h watch_context_ = nullptr;  // TCP only
  ucp_worker_h watch_worker_ = nullptr;
  std::string watch_address_;
  std::chrono::steady_clock::time_point watched_{};  // when Progress() last drove it
  std::vector<ucp_ep_h> eps_;                        // data, by peer
  std::vector<ucp_ep_h> watch_eps_;        // failure detection only, by peer on this machine
  std::vector<ErrorHandlerArg> handlers_;  // sized once, before any endpoint points into it
  std::vector<std::string> failed_;        // by peer
  std::vector<std::string> peers_;         // where each announced itself, by rank
  std::vector<void*> bye_recvs_;           // the peers' byes, posted at Connect, by peer
  std::vector<char> bye_buffers_;          // where they land, by peer
  bool closed_ = false;                    // Close() ran
};

// One posted UCP send or receive. `request` is UCX's handle, null when the transfer
// completed at once.
class UcxRequest final : public Request {
 public:
  // `request` may be null only for a send (which then completed at once).
  UcxRequest(const RequestInfo& info, std::shared_ptr<UcxTransport> transport, void* request)
      : Request(info), transport_(std::move(transport)), request_(request) {
    if (request_ == nullptr) Finish(UCS_OK, 0);
  }

  ~UcxRequest() override {
    if (request_ == nullptr) return;
    if (!info().send) {
      // An unmatched receive is cancelled at once; one whose message is arriving finishes
      // first (into the buffer the caller still owns until we return).
      ucp_request_cancel(transport_->worker(), request_);
      const absl::Time until = absl::Now() + kTeardownBound;
      while (ucp_request_check_status(request_) == UCS_INPROGRESS && absl::Now() < until) {
        transport_->Progress();
      }
      if (ucp_request_check_status(request_) == UCS_INPROGRESS) {
        transport_->Abandon(info().peer, absl::StrCat("a receive (tag ", info().tag,
                                                      ") was abandoned before it completed"));
      }
    }
    ucp_request_free(request_);  // an incomplete send goes on inside UCX
  }

  absl::StatusOr<bool> Test() override {
    if (done_) return true;
    if (!error_.ok()) return error_;
    transport_->Progress();
    ucp_tag_recv_info_t received{};
    const ucs_status_t status = info().send ? ucp_request_check_status(request_)
                                            : ucp_tag_recv_request_test(request_, &received);
    if (status == UCS_INPROGRESS && !info().send && !cancelled_ &&
        transport_->PeerClosed(info().peer)) {
      // The peer closed its channel and all it sent has arrived: a receive still unmatched
      // never will be. Cancelling leaves one whose message is arriving to finish.
      cancelled_ = true;
      ucp_request_cancel(transport_->worker(), request_);
      return false;
    }
    if (status == UCS_INPROGRESS) {
      const std::string& failure = transport_->failure(info().peer);
      if (!failure.empty()) {
        error_ =
            transport_->Failure(info().send ? "Send" : "Recv", info().peer, info().tag, failure);
        return error_;
      }
      return false;
    }
    ucp_request_free(request_);
    request_ = nullptr;
    Finish(status, received.length);
    if (!error_.ok()) return error_;
    return true;
  }

 private:
  // The outcome of a finished transfer; a receive checks the message's size.
  void Finish(ucs_status_t status, size_t received) {
    const RequestInfo& i = info();
    if (status == UCS_ERR_CANCELED && cancelled_) {
      error_ = absl::UnavailableError(
          absl::StrCat("Recv on rank ", i.rank, " of ", i.size, " with rank ", i.peer, " (tag ",
                       i.tag, "): rank ", i.peer,
                       " closed its channel without sending this message (it finished "
                       "or failed)"));
    } else if (status == UCS_ERR_MESSAGE_TRUNCATED) {
      error_ = absl::InvalidArgumentError(
          absl::StrCat("Recv on rank ", i.rank, " from rank ", i.peer, " (tag ", i.tag,
                       "): message has more than the ", i.bytes,
                       " bytes the receive was posted for; both ends must agree on the size"));
    } else if (status != UCS_OK) {
      error_ = transport_->Failure(i.send ? "Send" : "Recv", i.peer, i.tag, UcsText(status));
    } else if (!i.send && static_cast<int64_t>(received) != i.bytes) {
      error_ = absl::InvalidArgumentError(
          absl::StrCat("Recv on rank ", i.rank, " from rank ", i.peer, " (tag ", i.tag,
                       "): message has ", received, " bytes but the receive was posted for ",
                       i.bytes, "; both ends must agree on the size"));
    } else {
      done_ = true;
    }
  }

  std::shared_ptr<UcxTransport> transport_;
  void* request_;
  bool cancelled_ = false;  // a receive cancelled because its peer closed
  bool done_ = false;
  absl::Status error_;
};

class UcxChannel final : public PointToPointChannel {
 public:
  UcxChannel(std::shared_ptr<UcxTransport> transport, const ChannelOptions& options)
      : PointToPointChannel(options), transport_(std::move(transport)) {}
  UcxChannel(const UcxChannel&) = delete;
  UcxChannel& operator=(const UcxChannel&) = delete;

  // The closing handshake (UcxTransport::Close): waits up to the channel's timeout for the
  // peers to close too, unless the channel is broken (the job is failing; its peers are
  // dead, silent or failing too).
  ~UcxChannel() override { transport_->Close(/*wait_for_peers=*/!broken(), timeout()); }

  int rank() const override { return transport_->rank(); }
  int size() const override { return transport_->size(); }
  absl::string_view backend() const override { return "ucx"; }

 protected:
  absl::StatusOr<std::unique_ptr<Request>> PostSend(const void* buf, int64_t bytes, int peer,
                                                    int tag) override {
    return Post(const_cast<void*>(buf), bytes, peer, tag, /*send=*/true);
  }
  absl::StatusOr<std::unique_ptr<Request>> PostRecv(void* buf, int64_t bytes, int peer,
                                                    int tag) override {
    return Post(buf, bytes, peer, tag, /*send=*/false);
  }

 private:
  absl::StatusOr<std::unique_ptr<Request>> Post(void* buf, int64_t bytes, int peer, int tag,
                                                bool send) {
    const absl::string_view operation = send ? "Send" : "Recv";
    if (const std::string& failure = transport_->failure(peer); !failure.empty()) {
      return transport_->Failure(operation, peer, tag, failure);
    }
    if (send && transport_->PeerClosed(peer)) {
      return absl::UnavailableError(
          absl::StrCat("Send on rank ", rank(), " of ", size(), " with rank ", peer, " (tag ", tag,
                       "): rank ", peer, " closed its channel (it finished or failed)"));
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.datatype = ucp_dt_make_contig(1);
    param.memory_type = UCS_MEMORY_TYPE_HOST;  // host buffers: no memory-type detection
    ucs_status_ptr_t request = nullptr;
    if (send) {
      request = ucp_tag_send_nbx(transport_->ep(peer), buf, static_cast<size_t>(bytes),
                                 WireTag(rank(), tag), &param);
    } else {
      // UCX 1.13 does not report the size of a message received at once
      // (recv_info stays unset), so a receive always returns a request to test.
      param.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      request = ucp_tag_recv_nbx(transport_->worker(), buf, static_cast<size_t>(bytes),
                                 WireTag(peer, tag), kFullMask, &param);
    }
    if (UCS_PTR_IS_ERR(request)) {
      return transport_->Failure(operation, peer, tag, UcsText(UCS_PTR_STATUS(request)));
    }
    return std::make_unique<UcxRequest>(RequestInfo{send, rank(), size(), peer, tag, bytes},
                                        transport_, request);
  }

  std::shared_ptr<UcxTransport> transport_;
};

// This rank's identity for "same host": the kernel's boot id (one per booted kernel,
// shared by its containers) and the network namespace's inode. Ranks in two network
// namespaces of one machine count as two hosts (their TCP reaches each other on their
// data addresses, as between machines; tests/netns emulates hosts so). Empty if the boot
// id is unreadable (then every peer counts as remote). No spaces (the published value is
// "<identity> <data address> <watch address>").
std::string HostIdentity() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  if (id.empty()) return id;
  struct stat net {};
  if (stat("/proc/self/ns/net", &net) == 0) {
    absl::StrAppend(&id, "/netns:", static_cast<uint64_t>(net.st_ino));
  }
  return id;
}

// How a rank reaches its peers' data channel, as it announced itself (the "where").
struct Whereabouts {
  std::string data_address;  // the worker's --data-address; "-" when none was given
  std::string ucx_address;   // the address UCX takes on its interface ("-": unknown)
  std::string interface;     // that interface ("-": unknown)
  std::string label;         // "worker w-1 on host h2"; may be empty

  // "198.19.0.3 (worker w-2 on host h2; UCX uses 198.18.0.3 on eth0)".
  std::string Describe() const {
    std::string inside = label;
    if (ucx_address != "-" && ucx_address != data_address) {
      absl::StrAppend(&inside, inside.empty() ? "" : "; ", "UCX uses ", ucx_address, " on ",
                      interface);
    }
    return Announced(data_address, inside);
  }
};

struct PeerAddresses {
  std::vector<std::string> addresses;        // UCP data worker addresses, by rank
  std::vector<std::string> watch_addresses;  // UCP watch worker addresses, by rank
  std::vector<bool> same_host;               // by rank
  std::vector<Whereabouts> where;            // by rank
};

// Publishes this rank's host identity, worker addresses and whereabouts under `prefix`
// and waits for every rank's; DeadlineExceeded names the ranks that did not publish.
absl::StatusOr<PeerAddresses> ExchangeAddresses(RendezvousStore& store, const std::string& prefix,
                                                int rank, int size, const std::string& address,
                                                const std::string& watch_address,
                                                const Whereabouts& here, absl::Duration timeout) {
  auto key = [&](int r) { return absl::StrCat(prefix, "/ucx/address/", r); };
  // "<host identity> <data address in hex> <watch address in hex> <data address> <UCX
  // address> <interface> <label...>": the coordinator's store carries values in protobuf
  // strings (UTF-8); the label, last, may hold spaces.
  const std::string host = HostIdentity();
  if (absl::Status s = store.Set(
          key(rank), absl::StrCat(host, " ", absl::BytesToHexString(address), " ",
                                  absl::BytesToHexString(watch_address), " ", here.data_address,
                                  " ", here.ucx_address, " ", here.interface, " ", here.label));
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("UCX channel '", prefix, "' on rank ", rank,
                                               ": publishing this rank's address: ", s.message()));
  }
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key(r));
  absl::StatusOr<std::vector<std::string>> values = store.Get(keys, timeout);
  if (values.ok()) {
    PeerAddresses peers;
    for (int r = 0; r < size; ++r) {
      const std::vector<std::string> fields =
          absl::StrSplit((*values)[static_cast<size_t>(r)], absl::MaxSplits(' ', 6));
      const auto is_hex = [](const std::string& hex) {
        return !hex.empty() && hex.size() % 2 == 0 &&
               hex.find_first_not_of("0123456789abcdef") == std::string::npos;
      };
      if (fields.size() != 7 || !is_hex(fields[1]) || !is_hex(fields[2])) {
        return absl::InvalidArgumentError(
            absl::StrCat("UCX channel '", prefix, "' on rank ", rank, ": rank ", r,
                         " published a malformed address under ", key(r),
                         "; is another job using this prefix?"));
      }
      peers.addresses.push_back(absl::HexStringToBytes(fields[1]));
      peers.watch_addresses.push_back(absl::HexStringToBytes(fields[2]));
      peers.same_host.push_back(!host.empty() && fields[0] == host);
      peers.where.push_back(Whereabouts{fields[3], fields[4], fields[5], fields[6]});
    }
    return peers;
  }
  const absl::Status& s = values.status();
  if (s.code() != absl::StatusCode::kDeadlineExceeded) {
    return absl::Status(s.code(), absl::StrCat("UCX channel '", prefix, "' on rank ", rank,
                                               ": waiting for the other ranks: ", s.message()));
  }
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    if (!store.Get({key(r)}, absl::ZeroDuration()).ok()) missing.push_back(r);
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "UCX channel '", prefix, "' on rank ", rank, " of ", size, ": rank",
      missing.size() > 1 ? "s " : " ", absl::StrJoin(missing, ", "), " did not join within ",
      absl::FormatDuration(timeout), "; they are dead, stuck, or not creating this channel"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataChannel>> CreateUcxChannel(RendezvousStore& store,
                                                              const std::string& prefix, int rank,
                                                              int size,
                                                              const UcxChannelOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("UCX channel '", prefix, "': rank ", rank,
                                                   " of size ", size,
                                                   " is not a rank in [0, size) of size >= 1"));
  }
  const std::string channel = absl::StrCat("UCX channel '", prefix, "' on rank ", rank);
  absl::StatusOr<UcxInterface> interface = UcxInterfaceOf(options.address);
  if (!interface.ok()) {
    return absl::Status(interface.status().code(),
                        absl::StrCat(channel, ": ", interface.status().message()));
  }
  const std::string interface_devices =
      std::getenv("UCX_NET_DEVICES") == nullptr ? interface->name : std::string();
  auto transport = std::make_shared<UcxTransport>(rank, size);
  if (absl::Status s = transport->Init(prefix, interface->name); !s.ok()) return s;
  // What the peers are told; "-" for what is unknown (no data address, or a host name, or
  // UCX_NET_DEVICES set by the environment, which decides the interface then).
  const auto known = [](const std::string& v) { return v.empty() ? std::string("-") : v; };
  const Whereabouts here{known(options.address),
                         known(interface_devices.empty() ? "" : interface->address),
                         known(interface_devices), options.label};
  absl::StatusOr<PeerAddresses> peers =
      ExchangeAddresses(store, prefix, rank, size, transport->address(), transport->watch_address(),
                        here, options.channel.timeout);
  if (!peers.ok()) return peers.status();
  // A peer on another host this host has no route to fails here, naming it, before any
  // endpoint: UCX's wire-up to it would stall until a timeout that names another rank.
  // A misconfigured address, not a transient fault: InvalidArgument, reported at once.
  std::vector<std::string> unroutable;
  for (int r = 0; r < size; ++r) {
    const Whereabouts& w = peers->where[static_cast<size_t>(r)];
    if (r == rank || peers->same_host[static_cast<size_t>(r)]) continue;
    const bool data_ok = w.data_address == "-" || Routable(w.data_address);
    const bool ucx_ok = w.ucx_address == "-" || Routable(w.ucx_address);
    if (!data_ok || !ucx_ok) unroutable.push_back(absl::StrCat("rank ", r, " at ", w.Describe()));
  }
  if (!unroutable.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(channel, " of ", size, ": ", NoRoute(unroutable)));
  }
  std::vector<std::string> described;
  for (const Whereabouts& w : peers->where) described.push_back(w.Describe());
  transport->set_peers(std::move(described));
  if (absl::Status s =
          transport->Connect(prefix, peers->addresses, peers->watch_addresses, peers->same_host);
      !s.ok()) {
    return s;
  }
  return std::make_unique<UcxChannel>(std::move(transport), options.channel);
}

}  // namespace rackrun::comm
