// ValidateJobSpec (jobspec/spec.h): one validator per section of the spec, in the order
// of job_spec.proto, then the checks that span sections. Each returns the first problem
// of its section as an InvalidArgument that starts with the field's full path.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/channel_names.h"
#include "jobspec/balancer.h"
#include "jobspec/data_blend.h"
#include "jobspec/device.h"
#include "jobspec/field_checks.h"
#include "jobspec/job_memory.h"
#include "jobspec/restart_policy.h"
#include "jobspec/spec.h"
#include "planner/planner.h"

namespace rackrun::jobspec {
namespace {

using rackrun::v1::JobSpec;

constexpr int kMaxTopK = 64;       // the MoE layer's per-token gate scratch (runtime/model.cc)
constexpr int kMaxThreads = 4096;  // beyond any machine; CheckJobFitsThisMachine asks this one

// model: sizes, attention heads, the residual mode and its streams, initialisation.
absl::Status ValidateModel(const rackrun::v1::ModelSpec& m) {
  if (m.vocab() < 0) {
    return FieldError("model.vocab", absl::StrCat("is ", m.vocab(),
                                                  "; it must be >= 0 (0 = from the token file)"));
  }
  if (absl::Status s = RequirePositive("model.width", m.width(), "the model width C, e.g. 128");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = RequirePositive("model.blocks", m.blocks(), "the number of blocks, e.g. 4");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = RequirePositive("model.heads", m.heads(), "the attention heads, e.g. 4");
      !s.ok()) {
    return s;
  }
  if (m.width() % m.heads() != 0) {
    return FieldError("model.heads",
                      absl::StrCat("model.width ", m.width(), " is not divisible by heads ",
                                   m.heads(), "; choose heads that divide the width"));
  }
  if ((m.width() / m.heads()) % 2 != 0) {
    return FieldError("model.heads",
                      absl::StrCat("head width ", m.width() / m.heads(),
                                   " is odd; rotary embeddings need an even head width"));
  }
  if (absl::Status s =
          RequirePositive("model.seq_len", m.seq_len(), "the sequence length, e.g. 128");
      !s.ok()) {
    return s;
  }
  if (!OneOf(m.residual(), {"vanilla", "hc", "mhc", "xhc", "xhc_flash", "xhc_flash4"})) {
    return FieldError("model.residual", absl::StrCat("unknown mode '", m.residual(),
                                                     "'; choose vanilla, hc, mhc, xhc, "
                                                     "xhc_flash or xhc_flash4"));
  }
  if (absl::Status s = AtLeast("model.streams", m.streams(), 1, "0 = the mode's default");
      !s.ok()) {
    return s;
  }
  if (m.residual() == "vanilla" && m.streams() != 1) {
    return FieldError("model.streams",
                      "vanilla has exactly 1 stream; remove model.streams or set 1");
  }
  const bool xhc = m.residual().rfind("xhc", 0) == 0;
  if (xhc) {
    if (m.active() < 1 || m.active() > m.streams()) {
      return FieldError("model.active",
                        absl::StrCat("active streams k = ", m.active(),
                                     " must lie in [1, streams N = ", m.streams(),
                                     "]; lower model.active or raise model.streams"));
    }
    if (m.fixed() < 0 || m.fixed() > m.active()) {
      return FieldError("model.fixed", absl::StrCat("fixed streams m = ", m.fixed(),
                                                    " must lie in [0, active k = ", m.active(),
                                                    "]; lower model.fixed"));
    }
    const int group = m.residual() == "xhc_flash" ? 2 : m.residual() == "xhc_flash4" ? 4 : 1;
    if ((2 * static_cast<int64_t>(m.blocks())) % group != 0) {
      return FieldError(
          "model.blocks",
          absl::StrCat(m.blocks(), " blocks give ", 2 * static_cast<int64_t>(m.blocks()),
                       " sublayers, not a multiple of ", m.residual(), "'s group of ", group,
                       "; use an even number of blocks or "
                       "another residual mode"));
    }
  } else if (m.active() != 0 || m.fixed() != 0) {
    return FieldError(m.active() != 0 ? "model.active" : "model.fixed",
                      absl::StrCat("only xhc modes use active/fixed streams, not '", m.residual(),
                                   "'; remove the field"));
  }
  if (!(m.rope_theta() > 1) || !std::isfinite(m.rope_theta())) {
    return FieldError("model.rope_theta", absl::StrCat("is ", m.rope_theta(),
                                                       "; it must be a finite number > 1 "
                                                       "(10000 is usual)"));
  }
  if (!m.precision().empty() && !OneOf(m.precision(), {"fp32", "tf32", "bf16"})) {
    return FieldError("model.precision", absl::StrCat("unknown precision '", m.precision(),
                                                      "'; choose fp32 (the default), tf32 or "
                                                      "bf16"));
  }
  if (!(m.init_std() > 0) || !(m.init_std() <= 1)) {
    return FieldError("model.init_std",
                      absl::StrCat("is ", m.init_std(),
                                   "; the initial weights' standard deviation must lie in (0, 1] "
                                   "(larger weights overflow float activations); 0.02 is usual"));
  }
  return absl::OkStatus();
}

// model.moe: experts, routing, expert sizes, balancing pressure.
absl::Status ValidateMoe(const rackrun::v1::MoeSpec& moe) {
  if (absl::Status s = RequirePositive("model.moe.experts", moe.experts(),
                                       "the number of routed experts, e.g. 16");
      !s.ok()) {
    return s;
  }
  if (moe.top_k() < 1 || moe.top_k() > moe.experts()) {
    return FieldError("model.moe.top_k", absl::StrCat("top_k ", moe.top_k(),
                                                      " must lie in [1, experts = ", moe.experts(),
                                                      "]; lower model.moe.top_k or add experts"));
  }
  if (moe.top_k() > kMaxTopK) {
    return FieldError("model.moe.top_k", absl::StrCat("top_k ", moe.top_k(), " exceeds ", kMaxTopK,
                                                      ", the most experts a token may use"));
  }
  if (moe.expert_hidden() < 0) {
    return FieldError(
        "model.moe.expert_hidden",
        absl::StrCat("is ", moe.expert_hidden(), "; it must be positive (0 = 2 x model.width)"));
  }
  if (moe.expert_hidden() == 0) {
    return FieldError("model.moe.expert_hidden",
                      "required: the default 2 x model.width does not fit an int32; set it");
  }
  if (moe.shared_hidden() < 0) {
    return FieldError("model.moe.shared_hidden",
                      absl::StrCat("is ", moe.shared_hidden(),
                                   "; it must be >= 0 (0 = model.moe.expert_hidden)"));
  }
  for (const auto& [path, value] :
       {std::pair<const char*, double>{"model.moe.aux_loss_coef", moe.aux_loss_coef()},
        {"model.moe.bias_update_rate", moe.bias_update_rate()}}) {
    if (absl::Status s = Finite(path, value); !s.ok()) return s;
    if (value < 0)
      return FieldError(path, absl::StrCat("is ", value, "; it must be >= 0 (0 = off)"));
  }
  return absl::OkStatus();
}

// data: the datasets (one, or a blend; jobspec/data_blend.h) and the batch.
absl::Status ValidateData(const rackrun::v1::DataSpec& d) {
  if (absl::StatusOr<std::vector<BlendItem>> train = TrainBlendOf(d); !train.ok()) {
    return train.status();
  }
  if (absl::StatusOr<std::vector<BlendItem>> val = ValidationBlendOf(d); !val.ok()) {
    return val.status();
  }
  return AtLeast("data.batch_size", d.batch_size(), 1, "0 = the default 8");
}

// training: steps, microbatches, the learning-rate schedule, AdamW, clipping, evaluation.
absl::Status ValidateTraining(const rackrun::v1::TrainingSpec& t) {
  if (absl::Status s =
          RequirePositive("training.steps", t.steps(), "the optimizer steps, e.g. 300");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = AtLeast("training.microbatches", t.microbatches(), 1, "0 = the default 1");
      !s.ok()) {
    return s;
  }
  for (const auto& [path, value] : {std::pair<const char*, double>{"training.lr", t.lr()},
                                    {"training.min_lr", t.min_lr()},
                                    {"training.weight_decay", t.weight_decay()},
                                    {"training.beta1", t.beta1()},
                                    {"training.beta2", t.beta2()},
                                    {"training.adam_eps", t.adam_eps()},
                                    {"training.grad_clip", t.grad_clip()}}) {
    if (absl::Status s = Finite(path, value); !s.ok()) return s;
  }
  if (t.lr() <= 0) {
    return FieldError("training.lr",
                      absl::StrCat("is ", t.lr(), "; it must be positive (0 = the default 3e-3)"));
  }
  if (t.min_lr() < 0 || t.min_lr() > t.lr()) {
    return FieldError("training.min_lr",
                      absl::StrCat("is ", t.min_lr(), "; it must lie in [0, lr = ", t.lr(), "]"));
  }
  if (t.warmup_steps() < 0 || t.warmup_steps() > t.steps()) {
    return FieldError(
        "training.warmup_steps",
        absl::StrCat("is ", t.warmup_steps(), "; it must lie in [0, steps = ", t.steps(), "]"));
  }
  if (!OneOf(t.schedule(), {"cosine", "constant"})) {
    return FieldError("training.schedule", absl::StrCat("unknown schedule '", t.schedule(),
                                                        "'; choose cosine or constant"));
  }
  if (t.weight_decay() < 0) {
    return FieldError("training.weight_decay",
                      absl::StrCat("is ", t.weight_decay(), "; it must be >= 0 (0 = off)"));
  }
  if (t.beta1() < 0 || t.beta1() >= 1) {
    return FieldError("training.beta1", absl::StrCat("is ", t.beta1(), "; it must lie in [0, 1)"));
  }
  if (t.beta2() < 0 || t.beta2() >= 1) {
    return FieldError("training.beta2", absl::StrCat("is ", t.beta2(), "; it must lie in [0, 1)"));
  }
  if (t.adam_eps() <= 0) {
    return FieldError("training.adam_eps",
                      absl::StrCat("is ", t.adam_eps(), "; it must be positive, e.g. 1e-8"));
  }
  if (t.grad_clip() < 0) {
    return FieldError("training.grad_clip",
                      absl::StrCat("is ", t.grad_clip(), "; it must be >= 0 (0 = off)"));
  }
  if (absl::Status s = AtLeast("training.eval_interval", t.eval_interval(), 0, "0 = never");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = AtLeast("training.eval_batches", t.eval_batches(), 1, "0 = the default 8");
      !s.ok()) {
    return s;
  }
  return absl::OkStatus();
}

// balancer: the policy, replica slots, the planner's tolerances, where plans are made.
absl::Status ValidateBalancer(const rackrun::v1::BalancerSpec& b) {
  if (const planner::PolicyTraits* policy = planner::FindPolicy(b.policy());
      policy == nullptr || !policy->for_training) {
    return FieldError("balancer.policy", absl::StrCat("unknown policy '", b.policy(), "'; choose ",
                                                      TrainingPolicyChoices()));
  }
  if (absl::Status s = AtLeast("balancer.slots", b.slots(), 0, ""); !s.ok()) return s;
  if (absl::Status s = Finite("balancer.eps", b.eps()); !s.ok()) return s;
  if (b.eps() <= 0) {
    return FieldError("balancer.eps",
                      absl::StrCat("is ", b.eps(), "; it must be positive, e.g. 0.01"));
  }
  if (absl::Status s =
          AtLeast("balancer.min_replica_tokens", b.min_replica_tokens(), 1, "0 = the default 1");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = AtLeast("balancer.eplb_window", b.eplb_window(), 1, "0 = the default 16");
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          AtLeast("balancer.eplb_interval", b.eplb_interval(), 1, "0 = the default 16");
      !s.ok()) {
    return s;
  }
  if (FindBalancerMode(b.mode()) == nullptr) {
    return FieldError("balancer.mode", absl::StrCat("unknown mode '", b.mode(), "'; choose ",
                                                    BalancerModeChoices()));
  }
  return absl::OkStatus();
}

// checkpoint: how often, and how many are kept.
absl::Status ValidateCheckpoint(const rackrun::v1::CheckpointSpec& c) {
  if (absl::Status s = AtLeast("checkpoint.interval", c.interval(), 0, "0 = only at the end");
      !s.ok()) {
    return s;
  }
  if (c.keep() < 2) {
    return FieldError("checkpoint.keep",
                      absl::StrCat("is ", c.keep(),
                                   "; it must be >= 2 so the previous good checkpoint survives; "
                                   "set 2 or more"));
  }
  return absl::OkStatus();
}

// logging: how often.
absl::Status ValidateLogging(const rackrun::v1::LoggingSpec& l) {
  return AtLeast("logging.interval", l.interval(), 1, "0 = the default 10");
}

// resources: threads and ranks per job, the data channel, the device.
absl::Status ValidateResources(const rackrun::v1::ResourceSpec& r) {
  if (absl::Status s = AtLeast("resources.threads", r.threads(), 0, "0 = all cores"); !s.ok()) {
    return s;
  }
  if (r.threads() > kMaxThreads) {
    return FieldError("resources.threads",
                      absl::StrCat("is ", r.threads(), "; more than ", kMaxThreads,
                                   " threads per rank is beyond any machine: set at most the "
                                   "cores of one machine, or 0 for all of them"));
  }
  if (absl::Status s = AtLeast("resources.ranks", r.ranks(), 0, "0 = as launched"); !s.ok()) {
    return s;
  }
  if (comm::FindChannel(r.channel()) == nullptr) {
    return FieldError("resources.channel", absl::StrCat("unknown data channel '", r.channel(),
                                                        "'; choose ", comm::ChannelChoices()));
  }
  if (absl::StatusOr<DeviceSpec> d = ParseDevice(r.device()); !d.ok()) return d.status();
  return absl::OkStatus();
}

// model.precision x resources.device: the CPU engine computes in fp32 only.
absl::Status ValidatePrecisionOnDevice(const JobSpec& spec) {
  const std::string& p = spec.model().precision();
  if (p.empty() || p == "fp32") return absl::OkStatus();
  absl::StatusOr<DeviceSpec> d = ParseDevice(spec.resources().device());
  if (d.ok() && d->is_cuda()) return absl::OkStatus();
  return FieldError("model.precision",
                    absl::StrCat(p,
                                 " is a GPU precision and this job computes on the CPU, which "
                                 "computes in fp32; set resources.device: cuda, or "
                                 "model.precision: fp32"));
}

// parallelism: the expert-parallel degree G, a non-negative count (0 = all ranks).
absl::Status ValidateParallelism(const rackrun::v1::ParallelismSpec& p) {
  if (p.expert_parallel() < 0) {
    return FieldError("parallelism.expert_parallel",
                      absl::StrCat("is ", p.expert_parallel(),
                                   "; it is the ranks per expert-parallel domain: set a positive "
                                   "divisor of the ranks, or 0 for one domain of all ranks"));
  }
  return absl::OkStatus();
}

// model.moe.experts x the expert-parallel degree: every rank of a domain holds the same
// number of experts; with resources.ranks known, the domains tile the ranks.
absl::Status ValidateExpertSplit(const JobSpec& spec) {
  const int ranks = spec.resources().ranks();
  if (ranks > 0) return ExpertParallelLayoutOf(spec, ranks).status();
  // Ranks not known yet (as launched): one domain of G ranks must at least split the experts.
  const int g = spec.parallelism().expert_parallel();
  if (g > 0) return ExpertParallelLayoutOf(spec, g).status();
  return absl::OkStatus();
}

// The whole job: sizes no machine holds, or whose products overflow, are refused here, on
// every path (CLI, coordinator, worker), before anything is allocated.
absl::Status ValidateJobSize(const JobSpec& spec) {
  JobMemoryInputs inputs;
  inputs.ranks = std::max(1, spec.resources().ranks());
  inputs.threads = std::max(1, spec.resources().threads());
  absl::StatusOr<JobMemoryEstimate> memory = EstimateJobMemory(spec, inputs);
  if (!memory.ok()) return memory.status();
  if (memory->total > kMaxJobBytes) {
    const MemoryTerm& top = memory->terms.front();
    return FieldError(
        top.fields,
        absl::StrCat("the job would need an estimated ", memory->Describe(),
                     ", beyond any machine (", FormatBytes(kMaxJobBytes), "); largest: ", top.what,
                     " ", FormatBytes(top.bytes), " (", top.fields, "). Lower those sizes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobSpec(const JobSpec& spec) {
  if (absl::Status s = ValidateModel(spec.model()); !s.ok()) return s;
  if (absl::Status s = ValidateMoe(spec.model().moe()); !s.ok()) return s;
  if (absl::Status s = ValidateData(spec.data()); !s.ok()) return s;
  if (absl::Status s = ValidateTraining(spec.training()); !s.ok()) return s;
  if (absl::Status s = ValidateBalancer(spec.balancer()); !s.ok()) return s;
  if (absl::Status s = ValidateCheckpoint(spec.checkpoint()); !s.ok()) return s;
  if (absl::Status s = ValidateLogging(spec.logging()); !s.ok()) return s;
  if (absl::Status s = ValidateResources(spec.resources()); !s.ok()) return s;
  if (absl::Status s = ValidatePrecisionOnDevice(spec); !s.ok()) return s;
  if (absl::Status s = ValidateRestart(spec.restart()); !s.ok()) return s;
  if (absl::Status s = ValidateParallelism(spec.parallelism()); !s.ok()) return s;
  if (absl::Status s = ValidateExpertSplit(spec); !s.ok()) return s;
  return ValidateJobSize(spec);
}

absl::StatusOr<ExpertParallelLayout> ExpertParallelLayoutOf(const JobSpec& spec, int ranks) {
  if (absl::Status s = ValidateParallelism(spec.parallelism()); !s.ok()) return s;
  ExpertParallelLayout layout;
  layout.ranks = std::max(1, ranks);
  const int asked = spec.parallelism().expert_parallel();
  layout.expert_parallel = asked > 0 ? asked : layout.ranks;
  const int g = layout.expert_parallel;
  if (layout.ranks % g != 0) {
    return FieldError("parallelism.expert_parallel",
                      absl::StrCat(g, " ranks per domain do not divide the job's ", layout.ranks,
                                   " ranks into whole domains; set a divisor of ", layout.ranks,
                                   " (or 0 for one domain), or run a multiple of ", g, " ranks"));
  }
  layout.data_parallel = layout.ranks / g;
  const int experts = spec.model().moe().experts();
  if (experts % g != 0) {
    if (asked > 0) {
      return FieldError("parallelism.expert_parallel",
                        absl::StrCat(experts,
                                     " experts (model.moe.experts) cannot be split "
                                     "evenly over ",
                                     g, " ranks per domain; set a divisor of ", experts));
    }
    return FieldError("model.moe.experts",
                      absl::StrCat(experts, " experts cannot be split evenly over ", g,
                                   " ranks; use a multiple of the rank count, or set "
                                   "parallelism.expert_parallel to a divisor of both"));
  }
  return layout;
}

}  // namespace rackrun::jobspec
