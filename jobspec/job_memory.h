// What a job needs in memory, per rank, estimated from its spec; what this machine has;
// whether the one fits the other.
//
// EstimateJobMemory counts from the same shapes the model, AdamW, the MoE layers, the
// residual streams and the loader allocate (runtime/job_config_test.cc checks it against
// the parameters and resident memory of real models). ValidateJobSpec (jobspec/spec.h)
// refuses, on every machine, a spec whose estimate overflows or exceeds kMaxJobBytes.
// Whether a job fits *this* machine is CheckJobMemory's question, asked where the job
// runs (runtime/job_config.h: CheckJobFitsThisMachine).
#ifndef RACKRUN_JOBSPEC_JOB_MEMORY_H_
#define RACKRUN_JOBSPEC_JOB_MEMORY_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rackrun/v1/job_spec.pb.h"

namespace rackrun::jobspec {

// No job may need more than this per rank (1 PiB): beyond it a spec is refused
// everywhere, before any machine is asked.
inline constexpr int64_t kMaxJobBytes = int64_t{1} << 50;

// What the estimate depends on besides the spec.
struct JobMemoryInputs {
  int ranks = 1;                  // ranks: batch rows split over them, experts over
                                  // parallelism.expert_parallel of them (0: all)
  int threads = 1;                // compute threads per rank (per-thread scratch)
  int64_t vocab = 0;              // used when model.vocab is 0 (the token file's vocab)
  int64_t train_tokens = 0;       // token ids in data.train (held in memory as int32)
  int64_t validation_tokens = 0;  // token ids in data.validation
};

// One term of the estimate: bytes, what it is, and the spec fields that size it.
struct MemoryTerm {
  std::string what;    // e.g. "LM-head logits [tokens x vocab]"
  std::string fields;  // e.g. "model.vocab, data.batch_size, model.seq_len"
  int64_t bytes = 0;
};

// Bytes one rank of a job needs, by component. The model's float tensors are counted
// from the shapes they are allocated with (runtime/model.h and its layers): parameters
// and their gradients, AdamW's two moments, one microbatch's activations and backward
// scratch (attention probabilities, MoE dispatch buffers and expert hidden states with
// a balanced expert load, the residual streams' saved state, the LM-head logits; none for
// a cuda job, whose host model never runs a step), the token ids of a batch, replica slots of an
// expert-parallel run, the token files, and a fixed process overhead (code, libraries, thread
// stacks).
struct JobMemoryEstimate {
  int ranks = 1;
  int64_t parameters = 0;  // trainable weights and buffers of this rank
  int64_t gradients = 0;
  int64_t optimizer = 0;            // AdamW moments (+ the packed dense-gradient buffer, ranks > 1)
  int64_t activations = 0;          // one microbatch: saved forward state + backward scratch
  bool activations_on_gpu = false;  // a cuda job: none on the host (activations stays 0)
  int64_t batch = 0;                // token ids (inputs, targets, segment starts)
  int64_t expert_slots = 0;         // replica slots (ranks > 1)
  int64_t data = 0;                 // token files in memory
  int64_t overhead = 0;             // process: code, libraries, thread stacks
  int64_t total = 0;
  int64_t parameter_count = 0;    // trainable parameters of this rank
  std::vector<MemoryTerm> terms;  // the largest contributors, largest first

  // "9.4 GiB per rank (parameters 2.3 GiB, gradients 2.3 GiB, ...)".
  std::string Describe() const;
};

// The estimate; InvalidArgument naming the fields when a size product overflows 64 bits.
absl::StatusOr<JobMemoryEstimate> EstimateJobMemory(const rackrun::v1::JobSpec& spec,
                                                    const JobMemoryInputs& inputs);

// Memory of the machine this process runs on. Zero = unknown.
struct MachineMemory {
  int64_t total = 0;         // MemTotal
  int64_t available = 0;     // MemAvailable
  int64_t cgroup_limit = 0;  // memory.max (v2) or memory.limit_in_bytes (v1); 0 = none
  int64_t cgroup_usage = 0;  // memory.current / memory.usage_in_bytes
  // What a new job may use: MemAvailable, capped by the cgroup's room when limited.
  int64_t usable() const;
  std::string Describe() const;
};
// Reads /proc/meminfo and this process's cgroup (v2, then v1).
MachineMemory ReadMachineMemory();
// The parsing behind ReadMachineMemory: /proc/meminfo text, the cgroup limit file's text
// ("max" or bytes; empty = none) and its usage file's text.
MachineMemory ParseMachineMemory(std::string_view meminfo, std::string_view cgroup_limit,
                                 std::string_view cgroup_usage);

// OK when `ranks_here` ranks of `estimate` fit `machine.usable()`; otherwise
// ResourceExhausted starting with the fields of the largest term, with the estimate, its
// largest terms, the machine's memory, and what to lower. Unknown machine memory: OK.
absl::Status CheckJobMemory(const JobMemoryEstimate& estimate, int ranks_here,
                            const MachineMemory& machine);

// What a rank of a cuda job keeps on its GPU for the whole run, whatever a step's shapes:
// the parameters (and buffers), their gradients and AdamW's two moments, all fp32 (the GPU
// engine's activations, scratch and cuBLAS workspace come on top: runtime/cuda/README.md).
// A lower bound of the device memory the rank needs, counted like the host estimate's.
int64_t DeviceStateBytes(const JobMemoryEstimate& estimate);

// OK when one rank's DeviceStateBytes fit the GPU's `gpu_total_bytes` (0 = unknown: OK);
// otherwise ResourceExhausted starting with the fields of the largest weight term, with the
// bytes, the GPU (`gpu`, e.g. "cuda:0 (NVIDIA H200)") and what to lower. One rank: a worker
// does not know which of its host's ranks share its GPU, and a bound that cannot be met at
// all is what this check is for (not the GPU's free memory either: another process may be
// about to release it). Ranks sharing a GPU that together do not fit meet the allocator's
// error, which names the tensor and the bytes.
absl::Status CheckDeviceMemory(const JobMemoryEstimate& estimate, int64_t gpu_total_bytes,
                               std::string_view gpu);

// "1.5 GiB", "12.0 MiB", "640 B".
std::string FormatBytes(int64_t bytes);

}  // namespace rackrun::jobspec

#endif  // RACKRUN_JOBSPEC_JOB_MEMORY_H_
