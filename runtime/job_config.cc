#include "runtime/job_config.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "data/token_source.h"
#include "jobspec/data_blend.h"
#include "jobspec/device.h"
#include "jobspec/job_memory.h"
#include "jobspec/spec.h"
#include "runtime/cuda/device_probe.h"

namespace rackrun::runtime {

using rackrun::v1::JobSpec;

ModelConfig ModelConfigFromSpec(const JobSpec& spec) {
  const rackrun::v1::ModelSpec& m = spec.model();
  ModelConfig c;
  c.vocab = m.vocab();
  c.width = m.width();
  c.blocks = m.blocks();
  c.heads = m.heads();
  c.seq_len = m.seq_len();
  c.residual = m.residual();
  c.streams = m.streams();
  c.active = m.active();
  c.fixed = m.fixed();
  c.moe.experts = m.moe().experts();
  c.moe.top_k = m.moe().top_k();
  c.moe.expert_hidden = m.moe().expert_hidden();
  c.moe.shared_expert = m.moe().shared_expert();
  c.moe.shared_hidden = m.moe().shared_hidden();
  c.moe.aux_loss_coef = m.moe().aux_loss_coef();
  c.moe.bias_update_rate = m.moe().bias_update_rate();
  c.rope_theta = m.rope_theta();
  c.init_std = m.init_std();
  return c;
}

TrainConfig TrainConfigFromSpec(const JobSpec& spec) {
  TrainConfig c;
  const rackrun::v1::TrainingSpec& t = spec.training();
  c.name = spec.name();
  c.train_path = spec.data().train();
  c.validation_path = spec.data().validation();
  c.batch_size = spec.data().batch_size();
  c.seq_len = spec.model().seq_len();
  c.steps = t.steps();
  c.seed = t.seed();
  c.microbatches = t.microbatches();
  c.schedule = {.lr = t.lr(),
                .min_lr = t.min_lr(),
                .warmup = t.warmup_steps(),
                .total = t.steps(),
                .cosine = t.schedule() == "cosine"};
  c.adamw = {.beta1 = t.beta1(),
             .beta2 = t.beta2(),
             .eps = t.adam_eps(),
             .weight_decay = t.weight_decay()};
  c.grad_clip = t.grad_clip();
  c.eval_interval = t.eval_interval();
  c.eval_batches = t.eval_batches();
  c.checkpoint_dir = spec.checkpoint().dir();
  c.checkpoint_interval = spec.checkpoint().interval();
  c.checkpoint_keep = spec.checkpoint().keep();
  c.checkpoint_start_over = spec.checkpoint().start_over();
  c.log_interval = spec.logging().interval();
  c.log_json = spec.logging().json();
  c.load_trace = spec.logging().load_trace();
  c.threads = spec.resources().threads();
  return c;
}

namespace {

// The training data's vocabulary as its first dataset records it (0 when it does not, or
// cannot be opened: the trainer reports the data's problem when it opens it).
int64_t DataVocab(const JobSpec& spec) {
  absl::StatusOr<std::vector<jobspec::BlendItem>> blend = jobspec::TrainBlendOf(spec.data());
  if (!blend.ok() || blend->empty()) return 0;
  absl::StatusOr<std::unique_ptr<data::TokenSource>> source =
      data::TokenSource::Open(blend->front().path);
  return source.ok() ? (*source)->tokenizer().vocab : 0;
}

}  // namespace

int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

namespace {

// CheckJobDevice's checks; the GPU when the job runs on one (local rank 0's, standing for
// this machine's ranks), nullopt for cpu.
absl::StatusOr<std::optional<cuda::GpuInfo>> ProbeJobDevice(const JobSpec& spec, int ranks_here) {
  absl::StatusOr<jobspec::DeviceSpec> device = jobspec::ParseDevice(spec.resources().device());
  if (!device.ok()) return device.status();
  if (!device->is_cuda()) return std::nullopt;
  // Local rank 0 stands for this machine's ranks: plain "cuda" needs one GPU per local rank
  // (checked against ranks_here), "cuda:N" needs GPU N.
  absl::StatusOr<cuda::GpuInfo> gpu = cuda::CheckDevice(*device, 0, std::max(1, ranks_here));
  if (!gpu.ok()) return gpu.status();
  // The GPU engine runs some residual modes; the others are refused here, naming the mode.
  if (absl::Status s = cuda::CheckGpuResidualMode(spec.model().residual()); !s.ok()) return s;
  return *std::move(gpu);
}

}  // namespace

absl::Status CheckJobDevice(const JobSpec& spec, int ranks_here) {
  return ProbeJobDevice(spec, ranks_here).status();
}

absl::StatusOr<jobspec::JobMemoryEstimate> CheckJobFitsThisMachine(const JobSpec& spec, int ranks,
                                                                   int ranks_here, int threads) {
  absl::StatusOr<std::optional<cuda::GpuInfo>> gpu = ProbeJobDevice(spec, ranks_here);
  if (!gpu.ok()) return gpu.status();
  const int cores = UsableCores();
  if (threads > cores) {
    return absl::InvalidArgumentError(
        absl::StrCat("resources.threads: ", threads,
                     " threads per rank on a machine where this process may "
                     "use ",
                     cores,
                     " cores would oversubscribe them (every OpenMP barrier then waits for "
                     "descheduled threads: many times slower); set at most ",
                     cores, ", or 0 for all cores"));
  }
  jobspec::JobMemoryInputs inputs;
  inputs.ranks = std::max(1, ranks);
  inputs.threads = threads > 0 ? threads : cores;
  // The datasets are memory-mapped, not held: only the vocabulary sizes anything.
  inputs.vocab = DataVocab(spec);
  absl::StatusOr<jobspec::JobMemoryEstimate> estimate = jobspec::EstimateJobMemory(spec, inputs);
  if (!estimate.ok()) return estimate.status();
  if (absl::Status s = jobspec::CheckJobMemory(*estimate, ranks_here, jobspec::ReadMachineMemory());
      !s.ok()) {
    return s;
  }
  if (gpu->has_value()) {
    const cuda::GpuInfo& g = **gpu;
    if (absl::Status s = jobspec::CheckDeviceMemory(
            *estimate, g.total_bytes, absl::StrCat("cuda:", g.index, " (", g.name, ")"));
        !s.ok()) {
      return s;
    }
  }
  return estimate;
}

}  // namespace rackrun::runtime
