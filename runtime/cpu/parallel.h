// Threading policy shared by the CPU kernels.
#ifndef RACKRUN_RUNTIME_CPU_PARALLEL_H_
#define RACKRUN_RUNTIME_CPU_PARALLEL_H_

#include <cstdint>

namespace rackrun::runtime::cpu {

// Loops touching fewer elements than this run on the calling thread: a fork/join costs
// more than the work, and on a shared machine every barrier risks waiting a scheduler
// time slice for a preempted thread. Each loop iteration computes the same values on
// any thread, so the choice never changes results.
inline constexpr int64_t kParallelMinWork = int64_t{1} << 15;

}  // namespace rackrun::runtime::cpu

#endif  // RACKRUN_RUNTIME_CPU_PARALLEL_H_
