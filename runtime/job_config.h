// The settings the model and the training loop run with, resolved from a defaulted,
// validated JobSpec (jobspec/spec.h).
#ifndef RACKRUN_RUNTIME_JOB_CONFIG_H_
#define RACKRUN_RUNTIME_JOB_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "jobspec/job_memory.h"
#include "jobspec/spec.h"
#include "rackrun/v1/job_spec.pb.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"

namespace rackrun::runtime {

// Settings of the training loop, resolved from a defaulted JobSpec.
struct TrainConfig {
  std::string name;
  std::string train_path;
  std::string validation_path;  // empty: no validation
  int batch_size = 0;
  int seq_len = 0;
  int64_t steps = 0;
  uint64_t seed = 0;
  int microbatches = 1;
  LearningRateSchedule schedule;
  AdamWConfig adamw;
  double grad_clip = 0;  // 0 = off
  int64_t eval_interval = 0;
  int eval_batches = 0;
  std::string checkpoint_dir;  // empty: no checkpoints
  int64_t checkpoint_interval = 0;
  int checkpoint_keep = 2;
  bool checkpoint_start_over = false;  // move another run's checkpoints aside
  int64_t log_interval = 10;
  std::string log_json;    // empty: none
  std::string load_trace;  // empty: none
  int threads = 0;         // 0: all cores
};

TrainConfig TrainConfigFromSpec(const rackrun::v1::JobSpec& spec);

// The model's configuration from a defaulted JobSpec (vocab as in the spec; the trainer
// fills a 0 from the token file).
ModelConfig ModelConfigFromSpec(const rackrun::v1::JobSpec& spec);

// Whether the job fits the machine this process runs on, asked where a job starts
// (`rackrun train`, the worker) before anything is allocated:
// - memory: EstimateJobMemory (jobspec/job_memory.h) for one of `ranks` expert-parallel ranks,
//   with model.vocab 0 taken from the training data's record (the datasets themselves are
//   memory-mapped, so they add nothing), times
//   `ranks_here` ranks on this machine, against ReadMachineMemory(); ResourceExhausted
//   naming the fields of the largest term, with the estimate and the machine's memory;
// - threads: `threads` per rank (0 = all cores) above this process's usable cores is an
//   InvalidArgument naming resources.threads (oversubscribed OpenMP teams run many
//   times slower than the cores allow).
// - device: CheckJobDevice below, first; for a cuda job, after the host's memory, the GPU's:
//   jobspec::CheckDeviceMemory (a rank's parameters, gradients and AdamW moments against the
//   GPU's total memory), ResourceExhausted naming the fields.
// Returns the estimate when the job fits.
absl::StatusOr<jobspec::JobMemoryEstimate> CheckJobFitsThisMachine(const rackrun::v1::JobSpec& spec,
                                                                   int ranks, int ranks_here,
                                                                   int threads);

// Whether resources.device is usable by the `ranks_here` ranks on this machine: OK for cpu;
// for cuda and cuda:N the checks of runtime/cuda/device_probe.h (no GPU visible, driver
// older than the build's CUDA, index out of range, compute capability below the build's),
// each a FailedPrecondition naming resources.device and the cause; then, when the GPU
// passes them, Unimplemented naming model.residual for a mode the GPU engine does not run
// (device_probe.h's CheckGpuResidualMode). Whether this program has the GPU engine linked is
// the trainer's question (TrainerOptions::device_engine).
absl::Status CheckJobDevice(const rackrun::v1::JobSpec& spec, int ranks_here);

// Cores this process may run on (its CPU affinity), at least 1.
int UsableCores();

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_JOB_CONFIG_H_
