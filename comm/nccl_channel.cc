#include "comm/nccl_channel.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/progress.h"

namespace rackrun::comm {
namespace {

absl::Status CudaError(absl::string_view call, cudaError_t code) {
  return absl::InternalError(absl::StrCat(call, " failed: ", cudaGetErrorString(code)));
}

absl::Status NcclError(absl::string_view call, ncclResult_t code, ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  return absl::InternalError(absl::StrCat(
      call, " failed: ", ncclGetErrorString(code), last != nullptr && *last != '\0' ? " (" : "",
      last != nullptr ? last : "", last != nullptr && *last != '\0' ? ")" : ""));
}

// A non-blocking communicator's configuration: every call returns at once and is waited for
// by polling, so every wait can time out.
ncclConfig_t NonBlockingConfig() {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wold-style-cast"
#pragma GCC diagnostic ignored "-Wpedantic"
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
#pragma GCC diagnostic pop
  config.blocking = 0;
  return config;
}

ncclDataType_t NcclType(DataType type) {
  switch (type) {
    case DataType::kByte:
      return ncclUint8;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
  }
  return ncclUint8;
}

// Device memory that grows on demand (host-buffer mode's staging area).
class DeviceScratch {
 public:
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::StatusOr<void*> Get(int64_t bytes) {
    if (bytes > capacity_) {
      if (ptr_ != nullptr) cudaFree(ptr_);
      ptr_ = nullptr;
      capacity_ = 0;
      if (cudaError_t e = cudaMalloc(&ptr_, static_cast<size_t>(bytes)); e != cudaSuccess) {
        return CudaError(absl::StrCat("cudaMalloc(", bytes, " bytes)"), e);
      }
      capacity_ = bytes;
    }
    return ptr_;
  }

 private:
  void* ptr_ = nullptr;
  int64_t capacity_ = 0;
};

// One point-to-point operation; shared between its Request and the channel, which
// records its completion event at the end of the NCCL group it was posted in.
struct P2pOp {
  bool send = false;
  void* host = nullptr;    // host buffer in host-buffer mode
  void* device = nullptr;  // staging copy owned by the op in host-buffer mode
  int64_t bytes = 0;
  cudaEvent_t event = nullptr;
  bool recorded = false;
  bool done = false;

  ~P2pOp() {
    if (event != nullptr) cudaEventDestroy(event);
    // If the transfer never finished the job is ending; freeing would wait for it.
    if (device != nullptr && done) cudaFree(device);
  }
};

class NcclRequest final : public Request {
 public:
  NcclRequest(const RequestInfo& info, std::shared_ptr<P2pOp> op)
      : Request(info), op_(std::move(op)) {}

  absl::StatusOr<bool> Test() override {
    if (op_->done) return true;
    if (!op_->recorded) {
      return absl::FailedPreconditionError(absl::StrCat(
          "NCCL ", info().send ? "Isend" : "Irecv", " on rank ", info().rank, " with peer ",
          info().peer, " was posted inside a group that has not ended; call GroupEnd first"));
    }
    const cudaError_t q = cudaEventQuery(op_->event);
    if (q == cudaErrorNotReady) return false;
    if (q != cudaSuccess) return CudaError("cudaEventQuery", q);
    if (!op_->send && op_->host != nullptr && op_->bytes > 0) {
      if (cudaError_t e = cudaMemcpy(op_->host, op_->device, static_cast<size_t>(op_->bytes),
                                     cudaMemcpyDeviceToHost);
          e != cudaSuccess) {
        return CudaError("cudaMemcpy(device to host)", e);
      }
    }
    op_->done = true;
    return true;
  }

 private:
  std::shared_ptr<P2pOp> op_;
};

class NcclChannel final : public DataChannel {
 public:
  // `root_ranks`: this channel's ranks by their rank in the channel at the root of the
  // splits (empty for a root channel: the identity).
  NcclChannel(ncclComm_t comm, cudaStream_t stream, int rank, int size,
              const NcclChannelOptions& options, std::vector<int> root_ranks = {})
      : DataChannel(options.channel),
        comm_(comm),
        stream_(stream),
        rank_(rank),
        size_(size),
        device_(options.device),
        host_(options.host_buffers),
        root_ranks_(std::move(root_ranks)) {}

  ~NcclChannel() override {
    bool finalized = false;
    const ncclResult_t finalize = broken_.ok() ? ncclCommFinalize(comm_) : ncclInternalError;
    if (finalize == ncclSuccess || finalize == ncclInProgress) {
      // Non-blocking communicator: finalize completes asynchronously; bounded wait.
      const absl::Time deadline = absl::Now() + timeout();
      ProgressBackoff backoff;
      ncclResult_t state = ncclInProgress;
      while (state == ncclInProgress && absl::Now() < deadline) {
        ncclCommGetAsyncError(comm_, &state);
        backoff.Idle();
      }
      finalized = state == ncclSuccess;
    }
    if (finalized) {
      ncclCommDestroy(comm_);
    } else if (!aborted_) {
      ncclCommAbort(comm_);
    }
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::string_view backend() const override { return "nccl"; }
  bool matches_by_tag() const override { return false; }
  bool takes_device_buffers() const override { return true; }

  // The collectives count themselves for progress() around the NCCL calls below.
  absl::Status Allgather(const void* send, void* recv, int64_t count, DataType type) override {
    EnterCollective();
    return CompleteCollective(AllgatherImpl(send, recv, count, type, host_));
  }
  absl::Status AllToAllV(const void* send, std::span<const int64_t> send_counts,
                         std::span<const int64_t> send_displs, void* recv,
                         std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                         DataType type) override {
    EnterCollective();
    return CompleteCollective(
        AllToAllVImpl(send, send_counts, send_displs, recv, recv_counts, recv_displs, type));
  }
  absl::Status AllReduce(const void* send, void* recv, int64_t count, DataType type,
                         ReduceOp op) override {
    EnterCollective();
    return CompleteCollective(AllReduceImpl(send, recv, count, type, op));
  }
  absl::Status Broadcast(void* buf, int64_t count, DataType type, int root) override {
    EnterCollective();
    return CompleteCollective(BroadcastImpl(buf, count, type, root));
  }
  absl::Status Barrier() override {
    EnterCollective();
    return CompleteCollective(BarrierImpl());
  }

  // `staged`: the buffers are host memory (host-buffer mode, or Split's own exchange).
  absl::Status AllgatherImpl(const void* send, void* recv, int64_t count, DataType type,
                             bool staged) {
    constexpr absl::string_view kOp = "Allgather";
    if (absl::Status s = Usable(kOp); !s.ok()) return s;
    if (absl::Status s = CheckCount(kOp, count); !s.ok()) return s;
    if (count == 0) return absl::OkStatus();  // NCCL is not asked to move nothing
    const absl::Time deadline = absl::Now() + timeout();
    const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(type));
    const void* in = send;
    void* out = recv;
    if (staged) {
      absl::StatusOr<void*> d_in = send_scratch_.Get(bytes);
      absl::StatusOr<void*> d_out = recv_scratch_.Get(bytes * size_);
      if (!d_in.ok()) return d_in.status();
      if (!d_out.ok()) return d_out.status();
      if (absl::Status s = ToDevice(*d_in, send, bytes); !s.ok()) return s;
      in = *d_in;
      out = *d_out;
    }
    if (absl::Status s = Enqueue(
            kOp, deadline,
            ncclAllGather(in, out, static_cast<size_t>(count), NcclType(type), comm_, stream_));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = WaitStream(kOp, deadline, AllPeers()); !s.ok()) return s;
    return staged ? ToHost(recv, out, bytes * size_) : absl::OkStatus();
  }

  absl::Status AllToAllVImpl(const void* send, std::span<const int64_t> send_counts,
                             std::span<const int64_t> send_displs, void* recv,
                             std::span<const int64_t> recv_counts,
                             std::span<const int64_t> recv_displs, DataType type) {
    constexpr absl::string_view kOp = "AllToAllV";
    if (absl::Status s = Usable(kOp); !s.ok()) return s;
    if (absl::Status s = CheckCountsAndDispls(kOp, send_counts, send_displs, "send"); !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckCountsAndDispls(kOp, recv_counts, recv_displs, "recv"); !s.ok()) {
      return s;
    }
    const absl::Time deadline = absl::Now() + timeout();
    const auto elem = static_cast<int64_t>(DataTypeSize(type));
    int64_t send_extent = 0;
    int64_t recv_extent = 0;
    std::vector<int> peers;
    for (int p = 0; p < size_; ++p) {
      send_extent = std::max(send_extent, (send_displs[p] + send_counts[p]) * elem);
      recv_extent = std::max(recv_extent, (recv_displs[p] + recv_counts[p]) * elem);
      if (p != rank_ && (send_counts[p] > 0 || recv_counts[p] > 0)) peers.push_back(p);
    }
    const auto* in = static_cast<const char*>(send);
    auto* out = static_cast<char*>(recv);
    // Host-buffer mode stages host buffers only: device buffers (takes_device_buffers) go as
    // they are, as in device-buffer mode.
    absl::StatusOr<bool> send_on_device = host_ ? OnThisDevice(send, kOp) : true;
    if (!send_on_device.ok()) return send_on_device.status();
    absl::StatusOr<bool> recv_on_device = host_ ? OnThisDevice(recv, kOp) : true;
    if (!recv_on_device.ok()) return recv_on_device.status();
    if (!*send_on_device) {
      absl::StatusOr<void*> d_in = send_scratch_.Get(send_extent);
      if (!d_in.ok()) return d_in.status();
      if (absl::Status s = ToDevice(*d_in, send, send_extent); !s.ok()) return s;
      in = static_cast<const char*>(*d_in);
    }
    if (!*recv_on_device) {
      absl::StatusOr<void*> d_out = recv_scratch_.Get(recv_extent);
      if (!d_out.ok()) return d_out.status();
      out = static_cast<char*>(*d_out);
    }
    ncclResult_t result = ncclGroupStart();
    for (int p = 0; p < size_ && result == ncclSuccess; ++p) {
      if (send_counts[p] > 0) {
        result = ncclSend(in + send_displs[p] * elem, static_cast<size_t>(send_counts[p]),
                          NcclType(type), p, comm_, stream_);
      }
      if (result == ncclSuccess && recv_counts[p] > 0) {
        result = ncclRecv(out + recv_displs[p] * elem, static_cast<size_t>(recv_counts[p]),
                          NcclType(type), p, comm_, stream_);
      }
    }
    const ncclResult_t end = ncclGroupEnd();
    if (result != ncclSuccess) return NcclError("ncclSend/ncclRecv", result, comm_);
    if (absl::Status s = Enqueue(kOp, deadline, end); !s.ok()) return s;
    if (absl::Status s = WaitStream(kOp, deadline, peers); !s.ok()) return s;
    return *recv_on_device ? absl::OkStatus() : ToHost(recv, out, recv_extent);
  }

  absl::Status AllReduceImpl(const void* send, void* recv, int64_t count, DataType type,
                             ReduceOp op) {
    constexpr absl::string_view kOp = "AllReduce";
    if (absl::Status s = Usable(kOp); !s.ok()) return s;
    if (absl::Status s = CheckCount(kOp, count); !s.ok()) return s;
    if (count == 0) return absl::OkStatus();  // NCCL is not asked to move nothing
    if (type == DataType::kByte || op != ReduceOp::kSum) {
      return absl::InvalidArgumentError(
          absl::StrCat("AllReduce on rank ", rank_, ": type ", DataTypeName(type),
                       " cannot be summed; use int32, int64, float32 or float64"));
    }
    const absl::Time deadline = absl::Now() + timeout();
    const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(type));
    const void* in = send;
    void* out = recv;
    // Host-buffer mode stages host buffers only (takes_device_buffers): one scratch buffer
    // carries a host send and a host receive, reduced in place.
    absl::StatusOr<bool> send_on_device = host_ ? OnThisDevice(send, kOp) : true;
    if (!send_on_device.ok()) return send_on_device.status();
    absl::StatusOr<bool> recv_on_device = host_ ? OnThisDevice(recv, kOp) : true;
    if (!recv_on_device.ok()) return recv_on_device.status();
    if (!*send_on_device || !*recv_on_device) {
      absl::StatusOr<void*> d = recv_scratch_.Get(bytes);
      if (!d.ok()) return d.status();
      if (!*send_on_device) {
        if (absl::Status s = ToDevice(*d, send, bytes); !s.ok()) return s;
        in = *d;
      }
      if (!*recv_on_device) out = *d;
    }
    if (absl::Status s = Enqueue(kOp, deadline,
                                 ncclAllReduce(in, out, static_cast<size_t>(count), NcclType(type),
                                               ncclSum, comm_, stream_));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = WaitStream(kOp, deadline, AllPeers()); !s.ok()) return s;
    return *recv_on_device ? absl::OkStatus() : ToHost(recv, out, bytes);
  }

  absl::Status BroadcastImpl(void* buf, int64_t count, DataType type, int root) {
    constexpr absl::string_view kOp = "Broadcast";
    if (absl::Status s = Usable(kOp); !s.ok()) return s;
    if (absl::Status s = CheckCount(kOp, count); !s.ok()) return s;
    if (count == 0) return absl::OkStatus();  // NCCL is not asked to move nothing
    if (absl::Status s = CheckPeer("Broadcast root", root); !s.ok()) return s;
    const absl::Time deadline = absl::Now() + timeout();
    const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(type));
    void* data = buf;
    if (host_) {
      absl::StatusOr<void*> d = recv_scratch_.Get(bytes);
      if (!d.ok()) return d.status();
      if (rank_ == root) {
        if (absl::Status s = ToDevice(*d, buf, bytes); !s.ok()) return s;
      }
      data = *d;
    }
    if (absl::Status s = Enqueue(kOp, deadline,
                                 ncclBroadcast(data, data, static_cast<size_t>(count),
                                               NcclType(type), root, comm_, stream_));
        !s.ok()) {
      return s;
    }
    std::vector<int> peers{root};
    if (rank_ == root) peers = AllPeers();
    if (absl::Status s = WaitStream(kOp, deadline, peers); !s.ok()) return s;
    return host_ && rank_ != root ? ToHost(buf, data, bytes) : absl::OkStatus();
  }

  absl::Status BarrierImpl() {
    constexpr absl::string_view kOp = "Barrier";
    if (absl::Status s = Usable(kOp); !s.ok()) return s;
    const absl::Time deadline = absl::Now() + timeout();
    absl::StatusOr<void*> d = barrier_scratch_.Get(sizeof(int32_t));
    if (!d.ok()) return d.status();
    if (absl::Status s =
            Enqueue(kOp, deadline, ncclAllReduce(*d, *d, 1, ncclInt32, ncclSum, comm_, stream_));
        !s.ok()) {
      return s;
    }
    return WaitStream(kOp, deadline, AllPeers());
  }

  absl::StatusOr<std::unique_ptr<Request>> Isend(const void* buf, int64_t count, DataType type,
                                                 int peer, int tag) override {
    return PostP2p("Isend", const_cast<void*>(buf), count, type, peer, tag, /*send=*/true);
  }
  absl::StatusOr<std::unique_ptr<Request>> Irecv(void* buf, int64_t count, DataType type, int peer,
                                                 int tag) override {
    return PostP2p("Irecv", buf, count, type, peer, tag, /*send=*/false);
  }

  absl::Status GroupStart() override {
    if (absl::Status s = Usable("GroupStart"); !s.ok()) return s;
    if (ncclResult_t r = ncclGroupStart(); r != ncclSuccess) {
      return NcclError("ncclGroupStart", r, comm_);
    }
    ++group_depth_;
    return absl::OkStatus();
  }

  absl::Status GroupEnd() override {
    if (group_depth_ == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("GroupEnd on rank ", rank_, " without a matching GroupStart"));
    }
    --group_depth_;
    if (absl::Status s = Enqueue("GroupEnd", absl::Now() + timeout(), ncclGroupEnd()); !s.ok()) {
      return s;
    }
    if (group_depth_ > 0) return absl::OkStatus();
    // The group's operations are enqueued now: mark their completion points.
    for (const std::shared_ptr<P2pOp>& op : unrecorded_) {
      if (cudaError_t e = cudaEventCreateWithFlags(&op->event, cudaEventDisableTiming);
          e != cudaSuccess) {
        return CudaError("cudaEventCreateWithFlags", e);
      }
      if (cudaError_t e = cudaEventRecord(op->event, stream_); e != cudaSuccess) {
        return CudaError("cudaEventRecord", e);
      }
      op->recorded = true;
    }
    unrecorded_.clear();
    return absl::OkStatus();
  }

  // ncclCommSplit, after an exchange of every rank's (color, key) so that a negative color
  // fails the split on every rank alike (ncclCommSplit would leave that rank out instead).
  // NCCL ranks the new communicator by (key, rank here), as MPI_Comm_split and the
  // point-to-point backends do; the sub-channel gets its own CUDA stream on this device.
  absl::StatusOr<std::unique_ptr<DataChannel>> Split(int color, int key) override {
    EnterCollective();
    absl::StatusOr<std::unique_ptr<DataChannel>> sub = SplitImpl(color, key);
    if (absl::Status s = CompleteCollective(sub.status()); !s.ok()) return s;
    return sub;
  }

 private:
  absl::StatusOr<std::unique_ptr<DataChannel>> SplitImpl(int color, int key) {
    constexpr absl::string_view kOp = "Split";
    const int64_t mine[2] = {color, key};
    std::vector<int64_t> all(2 * static_cast<size_t>(size_));
    if (absl::Status s = AllgatherImpl(mine, all.data(), 2, DataType::kInt64, /*staged=*/true);
        !s.ok()) {
      return s;
    }
    std::vector<int> members;  // ranks here of my color, ordered by (key, rank here)
    for (int r = 0; r < size_; ++r) {
      const int64_t c = all[2 * static_cast<size_t>(r)];
      if (c < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Split on rank ", rank_, ": rank ", RootRank(r), " passed color ", c,
            "; every rank must pass a color >= 0 (ranks of one color form a sub-channel)"));
      }
      if (c == color) members.push_back(r);
    }
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return all[2 * static_cast<size_t>(a) + 1] < all[2 * static_cast<size_t>(b) + 1];
    });
    const int my_rank =
        static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    const int sub_size = static_cast<int>(members.size());
    std::vector<int> root_ranks;
    root_ranks.reserve(members.size());
    for (const int r : members) root_ranks.push_back(RootRank(r));

    ncclConfig_t config = NonBlockingConfig();
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + timeout();
    ncclComm_t sub = nullptr;
    const ncclResult_t r = ncclCommSplit(comm_, color, key, &sub, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      return Break(NcclError("ncclCommSplit", r, comm_));
    }
    // The split is complete when both the parent and the new communicator say so.
    ProgressBackoff backoff;
    while (true) {
      ncclResult_t parent = ncclSuccess;
      ncclResult_t child = sub != nullptr ? ncclInProgress : ncclSuccess;
      ncclCommGetAsyncError(comm_, &parent);
      if (sub != nullptr) ncclCommGetAsyncError(sub, &child);
      if (parent == ncclSuccess && child == ncclSuccess && sub != nullptr) break;
      if ((parent != ncclSuccess && parent != ncclInProgress) ||
          (child != ncclSuccess && child != ncclInProgress)) {
        if (sub != nullptr) ncclCommAbort(sub);
        return Break(NcclError("ncclCommSplit",
                               parent != ncclSuccess && parent != ncclInProgress ? parent : child,
                               comm_));
      }
      if (absl::Now() >= deadline) {
        if (sub != nullptr) ncclCommAbort(sub);
        return TimedOut(kOp, absl::Now() - start, AllPeers());
      }
      backoff.Idle();
    }
    int nccl_rank = -1;
    int nccl_size = -1;
    ncclCommUserRank(sub, &nccl_rank);
    ncclCommCount(sub, &nccl_size);
    if (nccl_rank != my_rank || nccl_size != sub_size) {
      ncclCommAbort(sub);
      return absl::InternalError(
          absl::StrCat("Split on rank ", rank_, ": NCCL made rank ", nccl_rank, " of ", nccl_size,
                       " where (key, rank) order gives rank ", my_rank, " of ", sub_size));
    }
    cudaStream_t stream = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      ncclCommAbort(sub);
      return CudaError("cudaStreamCreateWithFlags", e);
    }
    NcclChannelOptions options;
    options.channel.timeout = timeout();
    options.device = device_;
    options.host_buffers = host_;
    return std::make_unique<NcclChannel>(sub, stream, my_rank, sub_size, options,
                                         std::move(root_ranks));
  }

  // A rank here by its rank in the channel at the root of the splits.
  int RootRank(int r) const {
    return root_ranks_.empty() ? r : root_ranks_[static_cast<size_t>(r)];
  }

  absl::Status Usable(absl::string_view operation) const {
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          operation, " on rank ", rank_, ": NCCL channel is broken by an earlier error (",
          broken_.message(), "); the job must stop"));
    }
    return absl::OkStatus();
  }

  std::vector<int> AllPeers() const {
    std::vector<int> peers;
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) peers.push_back(p);
    }
    return peers;
  }

  absl::Status Break(absl::Status status) {
    if (broken_.ok()) broken_ = status;
    return status;
  }

  absl::Status TimedOut(absl::string_view operation, absl::Duration waited,
                        const std::vector<int>& peers) {
    ncclCommAbort(comm_);
    aborted_ = true;
    std::vector<int> named;
    named.reserve(peers.size());
    for (const int p : peers) named.push_back(RootRank(p));
    return Break(absl::DeadlineExceededError(
        absl::StrCat(operation, " on rank ", rank_, " of ", size_, " timed out after ",
                     absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))),
                     " waiting for NCCL peer rank", named.size() > 1 ? "s " : " ",
                     absl::StrJoin(named, ", "), "; a rank is dead, stuck, or not calling ",
                     operation, " (NCCL cannot say which of them)")));
  }

  // Checks an NCCL call's result on the non-blocking communicator and waits until the
  // communicator has accepted the operation.
  absl::Status Enqueue(absl::string_view operation, absl::Time deadline, ncclResult_t result) {
    if (result != ncclSuccess && result != ncclInProgress) {
      return Break(NcclError(operation, result, comm_));
    }
    const absl::Time start = absl::Now();
    ProgressBackoff backoff;
    while (true) {
      ncclResult_t state = ncclSuccess;
      if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
        return Break(NcclError("ncclCommGetAsyncError", r, comm_));
      }
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return Break(NcclError(operation, state, comm_));
      if (absl::Now() >= deadline) return TimedOut(operation, absl::Now() - start, AllPeers());
      backoff.Idle();
    }
  }

  // Polls the stream until the enqueued work is done, an asynchronous NCCL error appears,
  // or the deadline passes.
  absl::Status WaitStream(absl::string_view operation, absl::Time deadline,
                          const std::vector<int>& peers) {
    const absl::Time start = absl::Now();
    ProgressBackoff backoff;
    while (true) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) return Break(CudaError("cudaStreamQuery", q));
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        return Break(NcclError(operation, state, comm_));
      }
      if (absl::Now() >= deadline) return TimedOut(operation, absl::Now() - start, peers);
      backoff.Idle();
    }
  }

  // True for device memory of this channel's GPU; InvalidArgument, naming `operation`, for
  // another GPU's.
  absl::StatusOr<bool> OnThisDevice(const void* p, absl::string_view operation) const {
    if (p == nullptr) return false;
    cudaPointerAttributes a{};
    if (cudaError_t e = cudaPointerGetAttributes(&a, p); e != cudaSuccess) {
      return CudaError("cudaPointerGetAttributes", e);
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) return false;
    if (a.device != device_) {
      return absl::InvalidArgumentError(absl::StrCat(operation, " on rank ", rank_,
                                                     ": a buffer is in GPU ", a.device,
                                                     "'s memory; this channel's GPU is ", device_));
    }
    return true;
  }

  absl::Status ToDevice(void* device, const void* host, int64_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    if (cudaError_t e = cudaMemcpyAsync(device, host, static_cast<size_t>(bytes),
                                        cudaMemcpyHostToDevice, stream_);
        e != cudaSuccess) {
      return CudaError("cudaMemcpyAsync(host to device)", e);
    }
    return absl::OkStatus();
  }

  // Called once the stream is idle, so the synchronous copy cannot hang.
  absl::Status ToHost(void* host, const void* device, int64_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    if (cudaError_t e =
            cudaMemcpy(host, device, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      return CudaError("cudaMemcpy(device to host)", e);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Request>> PostP2p(absl::string_view operation, void* buf,
                                                   int64_t count, DataType type, int peer, int tag,
                                                   bool send) {
    if (absl::Status s = Usable(operation); !s.ok()) return s;
    if (absl::Status s = CheckPeer(operation, peer); !s.ok()) return s;
    if (absl::Status s = CheckTag(operation, tag); !s.ok()) return s;
    if (absl::Status s = CheckCount(operation, count); !s.ok()) return s;
    auto op = std::make_shared<P2pOp>();
    op->send = send;
    op->bytes = count * static_cast<int64_t>(DataTypeSize(type));
    if (op->bytes == 0) {
      // Both ends post the same size, so both skip NCCL for an empty message.
      op->done = true;
      return std::make_unique<NcclRequest>(RequestInfo{send, rank_, size_, peer, tag, 0},
                                           std::move(op));
    }
    void* data = buf;
    // Host-buffer mode stages host buffers only (takes_device_buffers).
    absl::StatusOr<bool> on_device = host_ ? OnThisDevice(buf, operation) : true;
    if (!on_device.ok()) return on_device.status();
    if (!*on_device) {
      op->host = buf;
      if (cudaError_t e = cudaMalloc(&op->device, static_cast<size_t>(op->bytes));
          e != cudaSuccess) {
        return CudaError("cudaMalloc", e);
      }
      if (send) {
        if (cudaError_t e =
                cudaMemcpy(op->device, buf, static_cast<size_t>(op->bytes), cudaMemcpyHostToDevice);
            e != cudaSuccess) {
          return CudaError("cudaMemcpy(host to device)", e);
        }
      }
      data = op->device;
    }
    const bool implicit_group = group_depth_ == 0;
    if (implicit_group) {
      if (absl::Status s = GroupStart(); !s.ok()) return s;
    }
    const ncclResult_t r =
        send ? ncclSend(data, static_cast<size_t>(op->bytes), ncclUint8, peer, comm_, stream_)
             : ncclRecv(data, static_cast<size_t>(op->bytes), ncclUint8, peer, comm_, stream_);
    unrecorded_.push_back(op);
    if (implicit_group) {
      if (absl::Status s = GroupEnd(); !s.ok()) return s;
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      return Break(NcclError(send ? "ncclSend" : "ncclRecv", r, comm_));
    }
    return std::make_unique<NcclRequest>(RequestInfo{send, rank_, size_, peer, tag, op->bytes},
                                         std::move(op));
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_;
  int size_;
  int device_;
  bool host_;
  std::vector<int> root_ranks_;
  bool aborted_ = false;
  absl::Status broken_;
  int group_depth_ = 0;
  std::vector<std::shared_ptr<P2pOp>> unrecorded_;
  DeviceScratch send_scratch_;
  DeviceScratch recv_scratch_;
  DeviceScratch barrier_scratch_;
};

// Joins the communicator of `size` ranks identified by `id` as `rank`, on the device
// already set; bounded by `deadline`.
absl::StatusOr<std::unique_ptr<DataChannel>> InitNcclChannel(const ncclUniqueId& id, int rank,
                                                             int size, absl::Time deadline,
                                                             const NcclChannelOptions& options) {
  ncclConfig_t config = NonBlockingConfig();
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    return NcclError(absl::StrCat("ncclCommInitRankConfig on rank ", rank), r, comm);
  }
  ProgressBackoff backoff;
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm, &state);
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      ncclCommAbort(comm);
      return NcclError(absl::StrCat("ncclCommInitRankConfig on rank ", rank), state, nullptr);
    }
    if (absl::Now() >= deadline) {
      ncclCommAbort(comm);
      return absl::DeadlineExceededError(
          absl::StrCat("NCCL communicator init on rank ", rank, " of ", size, " timed out within ",
                       absl::FormatDuration(options.channel.timeout),
                       "; a rank is dead, stuck, or not creating its NCCL channel"));
    }
    backoff.Idle();
  }
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    ncclCommAbort(comm);
    return CudaError("cudaStreamCreateWithFlags", e);
  }
  return std::make_unique<NcclChannel>(comm, stream, rank, size, options);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataChannel>> CreateNcclChannel(DataChannel& bootstrap,
                                                               const NcclChannelOptions& options) {
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    return CudaError(absl::StrCat("cudaSetDevice(", options.device, ") on rank ", rank), e);
  }
  ncclUniqueId id;
  if (rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return NcclError("ncclGetUniqueId", r, nullptr);
    }
  }
  if (absl::Status s = bootstrap.Broadcast(&id, sizeof(id), DataType::kByte, 0); !s.ok()) {
    return s;
  }
  return InitNcclChannel(id, rank, size, absl::Now() + options.channel.timeout, options);
}

absl::StatusOr<std::unique_ptr<DataChannel>> CreateNcclChannel(RendezvousStore& store,
                                                               const std::string& prefix, int rank,
                                                               int size,
                                                               const NcclChannelOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL channel '", prefix, "': rank ", rank,
                                                   " of size ", size,
                                                   " is not a rank in [0, size) of size >= 1"));
  }
  const absl::Time deadline = absl::Now() + options.channel.timeout;
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    return CudaError(absl::StrCat("cudaSetDevice(", options.device, ") on rank ", rank), e);
  }
  const std::string key = prefix + "/nccl/unique_id";
  ncclUniqueId id;
  if (rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return NcclError("ncclGetUniqueId", r, nullptr);
    }
    const std::string bytes(reinterpret_cast<const char*>(&id), sizeof(id));
    if (absl::Status s = store.Set(key, bytes); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("NCCL channel '", prefix,
                                       "' on rank 0: publishing the unique id: ", s.message()));
    }
  } else {
    absl::StatusOr<std::vector<std::string>> value =
        store.Get({key}, std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!value.ok()) {
      return absl::Status(
          value.status().code(),
          absl::StrCat("NCCL channel '", prefix, "' on rank ", rank, " of ", size,
                       ": waiting for rank 0's unique id: ", value.status().message(),
                       value.status().code() == absl::StatusCode::kDeadlineExceeded
                           ? "; rank 0 is dead, stuck, or not creating this channel"
                           : ""));
    }
    if (value->front().size() != sizeof(id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("NCCL channel '", prefix, "' on rank ", rank, ": the store's '", key,
                       "' has ", value->front().size(), " bytes, not an NCCL unique id (",
                       sizeof(id), "); is another job using this prefix?"));
    }
    std::memcpy(&id, value->front().data(), sizeof(id));
  }
  return InitNcclChannel(id, rank, size, deadline, options);
}

}  // namespace rackrun::comm
