// The CUDA simulator's runtime (tests only; docs in README.md here): the part of the CUDA
// runtime API the GPU engine calls, on the CPU, so the engine's kernels and host code run
// and are compared with the CPU engine on a machine without a GPU.
//
// Contract:
// - Streams keep CUDA's order, not its timing: work queued on a stream (kernels, copies,
//   memsets, the simulated cuBLAS calls) runs, in the order it was queued, only when the
//   host waits for it (cudaStreamSynchronize, cudaEventSynchronize, a cudaEventQuery that
//   reports it done, cudaStreamWaitEvent's wait when the waiting stream runs, cudaFree,
//   cudaDeviceSynchronize, a copy to pageable host memory). A host that reads a result
//   without waiting for it reads the old bytes, as on a GPU that has not finished.
// - cudaMemcpy (the legacy default stream) does not wait for non-blocking streams.
// - Copies check their direction against where the pointers came from (cudaMalloc,
//   cudaHostAlloc, anything else is pageable host memory) and fail with
//   cudaErrorInvalidValue on a mismatch.
// - A copy from pinned memory reads it when it runs; if the host wrote it after issuing the copy
//   and before it ran (a race on a GPU; device work that wrote there meanwhile, a copy or a
//   kernel given a pointer into it, is not the host), the program stops, naming it.
// - Device memory (cudaMalloc) is not host-accessible: a host read or write through a device
//   pointer faults (the message names it), as on a GPU; kernels, copies and memsets reach it.
// - One simulated device (compute capability 9.0); every host thread may use it.
#ifndef RACKRUN_RUNTIME_CUDA_SIM_RUNTIME_H_
#define RACKRUN_RUNTIME_CUDA_SIM_RUNTIME_H_

#include <cuda_runtime_api.h>

#include <functional>
#include <source_location>

namespace rackrun::runtime::cuda::sim {

// What queued work is, for the census.
enum class Work { kKernel, kBlas };
// Queues `work` on `stream` (nullptr: the legacy default stream). It runs later, in the
// stream's order, on whichever host thread waits for it; of the runtime it may call Classify
// only (the simulated cuBLAS checks the grouped GEMM's pointers when it runs).
void Enqueue(cudaStream_t stream, Work what, std::function<void()> work);

// What the host asked of the simulated device (every thread's calls), counted since the
// program started or the last TakeCensus: the launches, copies and waits a step is made of,
// the same on every machine (a GPU's times are the benchmarks'). On a GPU each launch and
// copy costs microseconds of host time and each wait drains the device's queue.
struct Census {
  int64_t kernels = 0;  // kernel launches
  int64_t blas = 0;     // cuBLAS(Lt) calls: GEMMs and grouped GEMMs
  // cudaMemcpy(Async) by direction (host to host: none of them); empty copies are not counted
  int64_t copies_to_device = 0, copies_to_host = 0, copies_on_device = 0;
  int64_t pageable_copies = 0;  // of those copies, the ones to or from pageable host memory
  int64_t memsets = 0;
  // Calls that block the host until device work is done: stream, event and device
  // synchronizations, copies to pageable host memory, cudaMemcpy, cudaMemset, cudaFree and
  // cudaFreeHost.
  int64_t host_waits = 0;
  int64_t allocations = 0;  // cudaMalloc, cudaHostAlloc
  int64_t frees = 0;        // cudaFree, cudaFreeHost
};
// The census so far; counting starts again from zero.
Census TakeCensus();

// Where a pointer points: memory from cudaMalloc, from cudaHostAlloc, or anything else.
enum class Memory { kDevice, kPinned, kPageable };
Memory Classify(const void* p);
// The same for a pointer a kernel gets, which may be one past an allocation's end (an empty
// range): anywhere in the device memory's reserved range is device memory, the end of a pinned
// allocation is pinned.
Memory ClassifyArgument(const void* p);

// Queued work (a kernel given a pointer into it) may have written the pinned allocation `p`
// points into: a copy issued earlier from there may find its source changed.
void DeviceWrotePinned(const void* p);

// Stops the program, naming `kernel`'s launch site (null: other queued work), when a byte just
// outside a live cudaMalloc allocation (256 bytes before it, or from its end through the next
// 256-byte boundary and 256 more) has changed since the allocation: a write out of bounds.
void CheckRedzones(const std::source_location* kernel);

// Records `error` as the calling thread's last error (cudaGetLastError returns and clears it).
void SetLastError(cudaError_t error);
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), kept
// for the kernel's launches (scheduler.cc); false above the device's opt-in limit.
bool SetMaxDynamicShared(const void* kernel, int bytes);

}  // namespace rackrun::runtime::cuda::sim

#endif  // RACKRUN_RUNTIME_CUDA_SIM_RUNTIME_H_
