#include "comm/mpi_channel.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "comm/p2p_channel.h"

namespace rackrun::comm {
namespace {

// MPI counts are int: larger messages travel as consecutive pieces with one tag, which
// the non-overtaking rule keeps in order.
constexpr int64_t kMaxPieceBytes = int64_t{1} << 30;

absl::Status MpiError(absl::string_view call, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  return absl::InternalError(
      absl::StrCat(call, " failed: ", absl::string_view(text, static_cast<size_t>(length))));
}

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

class MpiRequest final : public Request {
 public:
  MpiRequest(const RequestInfo& info, std::vector<MPI_Request> requests,
             std::vector<int64_t> piece_bytes)
      : Request(info), requests_(std::move(requests)), piece_bytes_(std::move(piece_bytes)) {}

  ~MpiRequest() override {
    if (done_) return;
    for (MPI_Request& r : requests_) {
      if (r == MPI_REQUEST_NULL) continue;
      if (info().send) {
        // A send cannot be reliably cancelled; let MPI finish it in the background.
        MPI_Request_free(&r);
      } else {
        MPI_Cancel(&r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
    }
  }

  absl::StatusOr<bool> Test() override {
    if (done_) return true;
    int flag = 0;
    std::vector<MPI_Status> statuses(requests_.size());
    const int code =
        MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, statuses.data());
    if (code != MPI_SUCCESS) {
      int detail = code;
      for (const MPI_Status& s : statuses) {
        if (code == MPI_ERR_IN_STATUS && s.MPI_ERROR != MPI_SUCCESS) detail = s.MPI_ERROR;
      }
      return Fail(MpiError(info().send ? "MPI_Isend" : "MPI_Irecv", detail));
    }
    if (!flag) return false;
    done_ = true;
    if (!info().send) {
      for (size_t i = 0; i < statuses.size(); ++i) {
        int received = 0;
        MPI_Get_count(&statuses[i], MPI_BYTE, &received);
        if (received != piece_bytes_[i]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "Recv on rank ", info().rank, " from rank ", info().peer, " (tag ", info().tag,
              "): message piece has ", received, " bytes but the receive was posted for ",
              piece_bytes_[i], "; both ends must agree on the size"));
        }
      }
    }
    return true;
  }

 private:
  absl::Status Fail(absl::Status status) {
    return absl::Status(status.code(),
                        absl::StrCat("rank ", info().rank, " with peer ", info().peer, " (tag ",
                                     info().tag, "): ", status.message()));
  }

  std::vector<MPI_Request> requests_;
  std::vector<int64_t> piece_bytes_;
  bool done_ = false;
};

class MpiChannel final : public PointToPointChannel {
 public:
  MpiChannel(MPI_Comm comm, int rank, int size, const ChannelOptions& options)
      : PointToPointChannel(options), comm_(comm), rank_(rank), size_(size) {}
  ~MpiChannel() override { MPI_Comm_free(&comm_); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::string_view backend() const override { return "mpi"; }

 protected:
  int max_transport_tag() const override {
    int* bound = nullptr;
    int found = 0;
    MPI_Comm_get_attr(comm_, MPI_TAG_UB, &bound, &found);
    return found && bound != nullptr ? *bound : 32767;  // the standard's guaranteed minimum
  }

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
    std::vector<MPI_Request> requests;
    std::vector<int64_t> pieces;
    auto* base = static_cast<char*>(buf);
    int64_t offset = 0;
    do {
      const int64_t piece = std::min(kMaxPieceBytes, bytes - offset);
      MPI_Request r = MPI_REQUEST_NULL;
      const int code =
          send ? MPI_Isend(base + offset, static_cast<int>(piece), MPI_BYTE, peer, tag, comm_, &r)
               : MPI_Irecv(base + offset, static_cast<int>(piece), MPI_BYTE, peer, tag, comm_, &r);
      if (code != MPI_SUCCESS) {
        for (MPI_Request& posted : requests) {
          if (!send) MPI_Cancel(&posted);
          MPI_Request_free(&posted);
        }
        return MpiError(send ? "MPI_Isend" : "MPI_Irecv", code);
      }
      requests.push_back(r);
      pieces.push_back(piece);
      offset += piece;
    } while (offset < bytes);
    return std::make_unique<MpiRequest>(RequestInfo{send, rank_, size_, peer, tag, bytes},
                                        std::move(requests), std::move(pieces));
  }

  MPI_Comm comm_;
  int rank_;
  int size_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataChannel>> CreateMpiChannel(const ChannelOptions& options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    if (int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
        code != MPI_SUCCESS) {
      return MpiError("MPI_Init_thread", code);
    }
    std::atexit(FinalizeAtExit);
  }
  MPI_Comm comm = MPI_COMM_NULL;
  if (int code = MPI_Comm_dup(MPI_COMM_WORLD, &comm); code != MPI_SUCCESS) {
    return MpiError("MPI_Comm_dup", code);
  }
  // Errors come back as codes (turned into Status), never as an abort inside MPI.
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  return std::make_unique<MpiChannel>(comm, rank, size, options);
}

int LauncherWorldSize() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "PMI_SIZE"}) {
    const char* value = std::getenv(name);
    int size = 0;
    if (value != nullptr && absl::SimpleAtoi(value, &size) && size > 0) return size;
  }
  return 1;
}

int LauncherLocalRank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"}) {
    const char* value = std::getenv(name);
    int rank = 0;
    if (value != nullptr && absl::SimpleAtoi(value, &rank) && rank >= 0) return rank;
  }
  return 0;
}

void AbortJob(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  std::fflush(nullptr);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace rackrun::comm
