// The MPI backend (Open MPI 4.1): CPU ranks launched by `mpirun -np N` or
// `srun --mpi=pmix`; rank and world size come from MPI, i.e. from the launcher.
// Transport: MPI_Isend/MPI_Irecv of bytes on a private duplicate of MPI_COMM_WORLD; the
// collectives are those of p2p_channel.h (named-peer timeouts, fixed summation order).
#ifndef RACKRUN_COMM_MPI_CHANNEL_H_
#define RACKRUN_COMM_MPI_CHANNEL_H_

#include <memory>

#include "absl/status/statusor.h"
#include "comm/data_channel.h"

namespace rackrun::comm {

// Initializes MPI (MPI_THREAD_FUNNELED) unless the process already did, in which case the
// caller keeps ownership of MPI_Finalize; otherwise MPI is finalized at process exit.
// Collective over MPI_COMM_WORLD (it duplicates the communicator). Every channel must be
// destroyed before exit. Internal naming the MPI call on failure.
absl::StatusOr<std::unique_ptr<DataChannel>> CreateMpiChannel(const ChannelOptions& options = {});

// The world size the launcher announces in this process's environment, so a program can
// decide whether to start MPI at all: OMPI_COMM_WORLD_SIZE (mpirun), SLURM_STEP_NUM_TASKS
// (srun), PMI_SIZE; 1 when none is set or a value is not a positive integer.
int LauncherWorldSize();
// This process's rank on its machine as the launcher announces it: OMPI_COMM_WORLD_LOCAL_RANK
// (mpirun), SLURM_LOCALID (srun), LOCAL_RANK (torchrun-style launchers); 0 when none is set or
// a value is not a non-negative integer. `resources.device: cuda` gives local rank i GPU i.
int LauncherLocalRank();

// Ends every process of the job (MPI_Abort on MPI_COMM_WORLD) after a fatal error on this
// rank, so that peers blocked in a collective do not wait out their timeouts. Exits with
// `code` when MPI is not initialized. Does not return.
[[noreturn]] void AbortJob(int code);

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_MPI_CHANNEL_H_
