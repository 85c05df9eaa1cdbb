#include "runtime/job_config.h"

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

}  // namespace rackrun::runtime
