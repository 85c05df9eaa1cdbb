// The data-channel interface: how ranks of one job move bytes to each other. One abstract
// class (LevelDB Env-style); each backend lives in one file beside it:
//   mpi_channel.cc        Open MPI, CPU ranks (mpirun / srun --mpi=pmix)
//   ucx_channel.cc        UCX (shared memory / TCP), CPU ranks of a job bootstrapped from a
//                         rendezvous store (the worker daemons' default per-job channel)
//   gloo_channel.cc       Gloo over TCP, CPU ranks of a job bootstrapped from a rendezvous
//                         store (the worker daemons' other CPU channel)
//   nccl_channel.cc       NCCL, GPU ranks (compiled when CUDA + NCCL are found)
//   inprocess_channel.cc  threads of one process, for unit tests
//
// Contract shared by every backend:
// - Every call is made by one thread per rank (calls on one channel are not thread-safe).
// - Collectives (Allgather, AllToAllV, AllReduce, Broadcast, Barrier) must be called by all
//   ranks in the same order with matching arguments.
// - Every blocking wait is bounded by the channel's timeout. On expiry the call returns
//   DeadlineExceeded with one actionable line naming the operation, this rank and the
//   peer(s) still waited for. After a DeadlineExceeded from a collective the channel is
//   broken: its message matching is no longer defined, and every later call returns
//   FailedPrecondition quoting the first error. The job must stop.
// - Buffers are host memory, except on the NCCL backend in device-buffer mode (see
//   nccl_channel.h).
// - progress() is the one call that is thread-safe: a heartbeat thread may read it while
//   the rank's thread is blocked in a collective.
#ifndef RACKRUN_COMM_DATA_CHANNEL_H_
#define RACKRUN_COMM_DATA_CHANNEL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rackrun::comm {

class CompletionEvent;  // comm/progress.h

enum class DataType { kByte, kInt32, kInt64, kFloat32, kFloat64 };

// Size of one element in bytes.
size_t DataTypeSize(DataType type);
absl::string_view DataTypeName(DataType type);

enum class ReduceOp { kSum };

// Tunables, declared once (NCCL_PARAM-style): the default, then the environment variable
// that overrides it in ChannelOptions::FromEnv().
//   timeout  300 s  RACKRUN_COMM_TIMEOUT_S  bound on every blocking wait of a channel
struct ChannelOptions {
  absl::Duration timeout = absl::Seconds(300);

  // Defaults overridden by the environment; InvalidArgument names a malformed variable.
  static absl::StatusOr<ChannelOptions> FromEnv();
};

// User tags of point-to-point messages are in [0, kMaxUserTag); tags at and above it are
// reserved for the collectives built from point-to-point messages.
inline constexpr int kMaxUserTag = 30000;

// What a request moves, for completion checks and error messages.
struct RequestInfo {
  bool send = false;
  int rank = -1;  // this rank
  int size = 0;   // ranks in the channel
  int peer = -1;  // the other end
  int tag = 0;
  int64_t bytes = 0;
};

// A pending non-blocking send or receive. The buffer it was posted with must stay valid
// and untouched until Test() returns true or Wait() returns (with any status). Destroying
// an incomplete request cancels a receive; an incomplete send may still read its buffer.
class Request {
 public:
  explicit Request(const RequestInfo& info) : info_(info) {}
  virtual ~Request() = default;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

  // Drives progress once. True when complete; an error if the transfer failed (e.g. a
  // received message of a different size than posted).
  virtual absl::StatusOr<bool> Test() = 0;

  // Blocks until complete, or returns DeadlineExceeded after `timeout`, naming the
  // operation, this rank and the peer.
  absl::Status Wait(absl::Duration timeout);

  // The transport's event that is notified when this request may have completed (then
  // waits block on it), or null when Test() itself drives progress (waits poll).
  virtual const CompletionEvent* completion_event() const { return nullptr; }

  const RequestInfo& info() const { return info_; }

 private:
  RequestInfo info_;
};

// Waits for all `requests` (null entries are skipped) until `deadline`. `operation`
// names the caller's operation in the error; DeadlineExceeded lists every peer whose
// transfer is still incomplete, with its direction.
absl::Status WaitAll(std::span<const std::unique_ptr<Request>> requests, absl::Time deadline,
                     absl::string_view operation);

// How far a rank has got through the job's sequence of collectives, for hang detection:
// ranks blocked in collective n report entered = n and completed = n - 1; a rank that has
// not reached it reports entered < n, which names it as the one the others wait for.
struct ChannelProgress {
  int64_t collectives_entered = 0;
  int64_t collectives_completed = 0;
};

class DataChannel {
 public:
  virtual ~DataChannel() = default;
  DataChannel(const DataChannel&) = delete;
  DataChannel& operator=(const DataChannel&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "mpi", "ucx", "gloo", "nccl", "inprocess".
  virtual absl::string_view backend() const = 0;

  // True when point-to-point messages between two ranks match by tag (MPI, in-process).
  // False when they match in issue order regardless of tag (NCCL): callers must then post
  // both ends of every pair in the same order.
  virtual bool matches_by_tag() const { return true; }

  // The event every request of this channel reports as its completion_event() (null when
  // they poll); for wait loops over several requests of the channel.
  virtual const CompletionEvent* completion_event() const { return nullptr; }

  // True when AllToAllV, AllReduce, Isend and Irecv also take buffers in the memory of this
  // rank's GPU (device pointers under CUDA's unified addressing), not only host memory:
  // expert parallelism then moves a GPU engine's token rows and replica weights without a
  // trip through host memory (comm/token_dispatch.h's RowMover, runtime/expert_instances.h),
  // and the trainer reduces the engine's gradients where they are (runtime/device_engine.h).
  // NCCL's, in either buffer mode; the other calls of every channel take host memory (NCCL's
  // device-buffer mode: device memory) as before.
  virtual bool takes_device_buffers() const { return false; }

  absl::Duration timeout() const { return timeout_; }
  void set_timeout(absl::Duration timeout) { timeout_ = timeout; }

  // Collective calls (Allgather, AllToAllV, AllReduce, Broadcast, Barrier) this rank has
  // entered, and of those the ones that returned OK. Every call counts as entered, also
  // one that fails its argument checks or finds the channel broken: a rank that returned
  // an error is not in the collective any more, and its peers will time out on it.
  // Counted by the backends (point-to-point and NCCL); 0/0 on a backend that does not.
  // Thread-safe; readable from any thread at any time.
  ChannelProgress progress() const {
    return {entered_.load(std::memory_order_relaxed), completed_.load(std::memory_order_relaxed)};
  }

  // recv[r * count .. (r + 1) * count) = rank r's send[0 .. count). `count` is in elements
  // of `type` and equal on all ranks.
  virtual absl::Status Allgather(const void* send, void* recv, int64_t count, DataType type) = 0;

  // Rank r sends send[send_displs[d] .. + send_counts[d]) to each rank d and receives rank
  // s's block into recv[recv_displs[s] .. + recv_counts[s]). Counts and displacements are
  // in elements and have size() entries; recv_counts[s] on r must equal send_counts[r] on s.
  virtual absl::Status AllToAllV(const void* send, std::span<const int64_t> send_counts,
                                 std::span<const int64_t> send_displs, void* recv,
                                 std::span<const int64_t> recv_counts,
                                 std::span<const int64_t> recv_displs, DataType type) = 0;

  // recv[i] = sum over ranks of send[i]; `send` may equal `recv`. Backends state their
  // summation order; the MPI and in-process backends make results bit-identical on every
  // rank and run to run (see p2p_channel.h).
  virtual absl::Status AllReduce(const void* send, void* recv, int64_t count, DataType type,
                                 ReduceOp op) = 0;

  // Copies `root`'s buf[0 .. count) into every rank's buf.
  virtual absl::Status Broadcast(void* buf, int64_t count, DataType type, int root) = 0;

  // Returns once every rank has entered Barrier.
  virtual absl::Status Barrier() = 0;

  // Non-blocking point-to-point. `tag` is in [0, kMaxUserTag). A message matches the
  // oldest posted receive with the same (source, tag) (MPI's non-overtaking rule); its size
  // must equal the posted size. Sends to or receives from this rank itself are allowed.
  virtual absl::StatusOr<std::unique_ptr<Request>> Isend(const void* buf, int64_t count,
                                                         DataType type, int peer, int tag) = 0;
  virtual absl::StatusOr<std::unique_ptr<Request>> Irecv(void* buf, int64_t count, DataType type,
                                                         int peer, int tag) = 0;

  // Brackets a batch of Isend/Irecv calls that may depend on each other (NCCL's group
  // semantics: nothing is started before GroupEnd). No-ops on backends that start every
  // request at once. Requests posted inside a group are complete-able only after GroupEnd.
  virtual absl::Status GroupStart() { return absl::OkStatus(); }
  virtual absl::Status GroupEnd() { return absl::OkStatus(); }

  // Sub-groups (MPI_Comm_split's semantics): collective over every rank of this channel.
  // Ranks passing the same `color` form one sub-channel, ranked by (key, rank here);
  // colors must be >= 0 on every rank (else InvalidArgument on every rank). The
  // sub-channel is a DataChannel of its own: its collectives involve only its ranks, and
  // neither its point-to-point messages nor its collectives ever match messages of this
  // channel or of any other sub-channel (they run on the same transport in a tag range of
  // their own). It must be destroyed before this channel; it may be split again. It starts
  // with this channel's timeout, counts its own progress(), breaks on its own, and its
  // errors name peers by their rank in the channel at the root of the splits (the job's
  // rank). Every backend implements it (the point-to-point ones in p2p_channel.h, NCCL by
  // ncclCommSplit); the default answers Unimplemented (a wrapper channel without sub-groups).
  virtual absl::StatusOr<std::unique_ptr<DataChannel>> Split(int color, int key);

 protected:
  explicit DataChannel(const ChannelOptions& options) : timeout_(options.timeout) {}

  // Common argument checks; InvalidArgument names the argument and the fix.
  absl::Status CheckPeer(absl::string_view operation, int peer) const;
  absl::Status CheckTag(absl::string_view operation, int tag) const;
  absl::Status CheckCount(absl::string_view operation, int64_t count) const;
  absl::Status CheckCountsAndDispls(absl::string_view operation, std::span<const int64_t> counts,
                                    std::span<const int64_t> displs, absl::string_view which) const;

  // progress() bookkeeping for backends: call EnterCollective() first thing in a
  // collective and return CompleteCollective(status) from it.
  void EnterCollective() { entered_.fetch_add(1, std::memory_order_relaxed); }
  absl::Status CompleteCollective(absl::Status status) {
    if (status.ok()) completed_.fetch_add(1, std::memory_order_relaxed);
    return status;
  }

 private:
  absl::Duration timeout_;
  std::atomic<int64_t> entered_{0};
  std::atomic<int64_t> completed_{0};
};

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_DATA_CHANNEL_H_
