#include "runtime/trainer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "runtime/checkpoint.h"

namespace rackrun::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// The data order must not be the model's initialisation stream.
constexpr uint64_t kDataSeedSalt = 0xd1b54a32d192ed03ULL;

std::string PackU64(std::span<const uint64_t> values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size_bytes());
}

absl::Status UnpackU64(const Checkpoint& c, std::string_view name, std::span<uint64_t> out) {
  const CheckpointSection* s = c.Find(name);
  if (s == nullptr || s->payload.size() != out.size_bytes()) {
    return absl::DataLossError(absl::StrCat("checkpoint section '", std::string(name),
                                            "' is missing or has the wrong size"));
  }
  std::memcpy(out.data(), s->payload.data(), out.size_bytes());
  return absl::OkStatus();
}

std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.9g", v);
}

}  // namespace

std::string StepRecord::ToJson() const {
  std::vector<std::string> loads;
  for (const double l : expert_load_max_over_mean) loads.push_back(JsonNumber(l));
  return absl::StrCat("{\"step\": ", step, ", \"loss\": ", JsonNumber(loss),
                      ", \"val_loss\": ", val_loss ? JsonNumber(*val_loss) : "null",
                      ", \"tokens_per_s\": ", JsonNumber(tokens_per_s),
                      ", \"lr\": ", JsonNumber(lr), ", \"grad_norm\": ", JsonNumber(grad_norm),
                      ", \"elapsed_s\": ", JsonNumber(elapsed_s),
                      ", \"aux_loss\": ", JsonNumber(aux_loss),
                      ", \"expert_load_max_over_mean\": [", absl::StrJoin(loads, ", "), "]}");
}

std::string StepRecord::ToLogLine(int64_t total_steps) const {
  std::vector<std::string> loads;
  for (const double l : expert_load_max_over_mean) loads.push_back(absl::StrFormat("%.2f", l));
  return absl::StrFormat(
      "step %*d/%d  loss %.4f  val %s  tok/s %7.0f  lr %.2e  gnorm %6.3f  load %s  %6.1fs",
      static_cast<int>(std::to_string(total_steps).size()), step, total_steps, loss,
      val_loss ? absl::StrFormat("%.4f", *val_loss) : std::string("  -   "), tokens_per_s, lr,
      grad_norm, absl::StrJoin(loads, "/"), elapsed_s);
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const rackrun::v1::JobSpec& spec) {
  std::unique_ptr<Trainer> t(new Trainer());
  t->spec_ = spec;
  t->config_ = TrainConfigFromSpec(spec);
  const TrainConfig& c = t->config_;
  if (c.threads > 0) omp_set_num_threads(c.threads);

  absl::StatusOr<TokenFile> train = ReadTokenFile(c.train_path);
  if (!train.ok())
    return absl::InvalidArgumentError(absl::StrCat("data.train: ", train.status().message()));
  ModelConfig mc = ModelConfigFromSpec(spec);
  if (mc.vocab == 0) {
    mc.vocab = static_cast<int>(train->vocab);
    t->spec_.mutable_model()->set_vocab(mc.vocab);
  } else if (static_cast<uint32_t>(mc.vocab) < train->vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.vocab: ", mc.vocab, " is smaller than the token file's vocabulary ",
                     train->vocab, "; set model.vocab to 0 (from the file) or >= ", train->vocab));
  }
  t->end_of_document_ = train->end_of_document;
  t->train_entropy_ = UnigramEntropy(train->tokens, mc.vocab);
  absl::StatusOr<WindowLoader> loader =
      WindowLoader::Create(std::move(train->tokens), train->end_of_document, c.seq_len,
                           c.batch_size, c.seed ^ kDataSeedSalt, /*shuffle=*/true);
  if (!loader.ok())
    return absl::InvalidArgumentError(absl::StrCat("data.train: ", loader.status().message()));
  t->train_loader_ = std::make_unique<WindowLoader>(std::move(*loader));

  if (!c.validation_path.empty()) {
    absl::StatusOr<TokenFile> val = ReadTokenFile(c.validation_path);
    if (!val.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("data.validation: ", val.status().message()));
    }
    if (val->vocab > static_cast<uint32_t>(mc.vocab)) {
      return absl::InvalidArgumentError(
          absl::StrCat("data.validation: vocabulary ", val->vocab, " exceeds the model's ",
                       mc.vocab, "; make both token files with the same tokenizer"));
    }
    // Probe that it holds at least one validation microbatch.
    absl::StatusOr<WindowLoader> probe =
        WindowLoader::Create(val->tokens, val->end_of_document, c.seq_len, c.batch_size, 0, false);
    if (!probe.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("data.validation: ", probe.status().message()));
    }
    t->validation_tokens_ = std::move(val->tokens);
  }

  absl::StatusOr<std::unique_ptr<Model<float>>> model = Model<float>::Create(mc, c.seed);
  if (!model.ok()) {
    return model.status();  // already names the field (model.<field>: ...)
  }
  t->model_ = std::move(*model);
  std::vector<OptimizedTensor> tensors;
  for (const ParamRef<float>& p : t->model_->Parameters()) {
    tensors.push_back({p.name, p.value, p.grad, p.size, DecaysWeight(p.name)});
  }
  t->adam_ = std::make_unique<AdamW>(c.adamw, std::move(tensors));
  t->buffers_ = t->model_->Buffers();
  return t;
}

absl::StatusOr<StepRecord> Trainer::Step() {
  StepRecord r;
  const auto start = Clock::now();
  model_->ZeroGrad();
  const int micro = config_.microbatches;
  const auto scale = static_cast<float>(1.0 / micro);
  double loss_sum = 0;
  double aux_sum = 0;
  for (int m = 0; m < micro; ++m) {
    train_loader_->Next(batch_);
    absl::StatusOr<double> loss = model_->ForwardBackward(
        batch_.inputs, batch_.targets, batch_.batch, batch_.segment_starts, scale);
    if (!loss.ok()) return loss.status();
    loss_sum += *loss;
    aux_sum += model_->aux_loss();
  }
  r.loss = loss_sum / micro;
  r.aux_loss = aux_sum / micro;
  if (!std::isfinite(r.loss)) {
    return absl::FailedPreconditionError(
        absl::StrCat("loss is ", r.loss, " at step ", step_ + 1,
                     "; lower training.lr or raise training.warmup_steps"));
  }
  r.grad_norm = GlobalGradNorm(adam_->tensors());
  const double clip = config_.grad_clip;
  const double grad_scale = (clip > 0 && r.grad_norm > clip) ? clip / r.grad_norm : 1.0;
  r.lr = config_.schedule.At(step_);
  adam_->Step(r.lr, grad_scale);
  ++step_;
  r.step = step_;
  for (const std::vector<int64_t>& counts : model_->expert_counts()) {
    int64_t total = 0, max = 0;
    for (const int64_t n : counts) {
      total += n;
      max = std::max(max, n);
    }
    const double mean =
        counts.empty() ? 0 : static_cast<double>(total) / static_cast<double>(counts.size());
    r.expert_load_max_over_mean.push_back(mean > 0 ? static_cast<double>(max) / mean : 0);
  }
  const double seconds = Seconds(start);
  r.tokens_per_s =
      seconds > 0 ? static_cast<double>(micro) * batch_.batch * batch_.seq_len / seconds : 0;
  return r;
}

absl::StatusOr<double> Trainer::EvaluateValidation() {
  if (validation_tokens_.empty()) {
    return absl::FailedPreconditionError("the job has no validation data (data.validation)");
  }
  absl::StatusOr<WindowLoader> loader =
      WindowLoader::Create(validation_tokens_, end_of_document_, config_.seq_len,
                           config_.batch_size, 0, /*shuffle=*/false);
  if (!loader.ok()) return loader.status();
  // Never more batches than one pass holds, so every batch is a distinct window set.
  const int64_t per_pass = std::max<int64_t>(1, loader->windows_per_epoch() / config_.batch_size);
  const int64_t batches = std::min<int64_t>(config_.eval_batches, per_pass);
  Batch b;
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    loader->Next(b);
    absl::StatusOr<double> loss = model_->Evaluate(b.inputs, b.targets, b.batch, b.segment_starts);
    if (!loss.ok()) return loss.status();
    sum += *loss;
  }
  return sum / static_cast<double>(batches);
}

absl::StatusOr<std::string> Trainer::SaveCheckpoint() {
  if (config_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("checkpoint.dir is not set");
  }
  Checkpoint c;
  c.step = step_;
  const LoaderPosition pos = train_loader_->position();
  const uint64_t words[] = {static_cast<uint64_t>(step_),
                            static_cast<uint64_t>(adam_->step()),
                            pos.epoch,
                            pos.cursor,
                            pos.epoch_rng[0],
                            pos.epoch_rng[1],
                            pos.epoch_rng[2],
                            pos.epoch_rng[3]};
  c.sections.push_back({"trainer/state", PackU64(words)});
  c.sections.push_back({"spec/model", spec_.model().SerializeAsString()});
  c.sections.push_back({"spec/json", JobSpecToJson(spec_)});
  const std::vector<OptimizedTensor>& tensors = adam_->tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const OptimizedTensor& t = tensors[i];
    c.sections.push_back({"param/" + t.name, PackFloats({t.value, static_cast<size_t>(t.size)})});
    c.sections.push_back({"adam_m/" + t.name, PackFloats(adam_->first_moment(i))});
    c.sections.push_back({"adam_v/" + t.name, PackFloats(adam_->second_moment(i))});
  }
  for (const ParamRef<float>& b : buffers_) {
    c.sections.push_back({"buffer/" + b.name, PackFloats({b.value, static_cast<size_t>(b.size)})});
  }
  return ::rackrun::runtime::SaveCheckpoint(config_.checkpoint_dir, c, config_.checkpoint_keep);
}

absl::Status Trainer::Resume(const std::string& path) {
  std::string loaded;
  absl::StatusOr<Checkpoint> c = LoadCheckpointForResume(path, &loaded);
  if (!c.ok()) return c.status();
  const CheckpointSection* model_spec = c->Find("spec/model");
  if (model_spec == nullptr || model_spec->payload != spec_.model().SerializeAsString()) {
    rackrun::v1::ModelSpec theirs;
    if (model_spec != nullptr) theirs.ParseFromString(model_spec->payload);
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint '", loaded, "' was written for a different model (",
                     theirs.ShortDebugString(), ") than this spec's (",
                     spec_.model().ShortDebugString(), "); resume with the spec that wrote it"));
  }
  uint64_t words[8];
  if (absl::Status s = UnpackU64(*c, "trainer/state", words); !s.ok()) return s;
  const std::vector<OptimizedTensor>& tensors = adam_->tensors();
  const auto missing = [&](const std::string& name) {
    return absl::DataLossError(absl::StrCat("checkpoint '", loaded, "' has no section '", name,
                                            "'; it was written by a different model"));
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const OptimizedTensor& t = tensors[i];
    const std::pair<std::string, std::span<float>> parts[] = {
        {"param/" + t.name, {t.value, static_cast<size_t>(t.size)}},
        {"adam_m/" + t.name, adam_->first_moment(i)},
        {"adam_v/" + t.name, adam_->second_moment(i)}};
    for (const auto& [name, out] : parts) {
      const CheckpointSection* s = c->Find(name);
      if (s == nullptr) return missing(name);
      if (absl::Status st = UnpackFloats(*s, out); !st.ok()) return st;
    }
  }
  for (const ParamRef<float>& b : buffers_) {
    const CheckpointSection* s = c->Find("buffer/" + b.name);
    if (s == nullptr) return missing("buffer/" + b.name);
    if (absl::Status st = UnpackFloats(*s, {b.value, static_cast<size_t>(b.size)}); !st.ok())
      return st;
  }
  LoaderPosition pos;
  pos.epoch = words[2];
  pos.cursor = words[3];
  for (int i = 0; i < 4; ++i) pos.epoch_rng[static_cast<size_t>(i)] = words[4 + i];
  if (absl::Status s = train_loader_->Restore(pos); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint '", loaded, "': ", s.message()));
  }
  step_ = static_cast<int64_t>(words[0]);
  adam_->set_step(static_cast<int64_t>(words[1]));
  return absl::OkStatus();
}

absl::StatusOr<TrainSummary> Trainer::Run(const std::function<void(const StepRecord&)>& on_record) {
  TrainSummary summary;
  summary.first_step = step_;
  summary.train_unigram_entropy = train_entropy_;
  std::FILE* json = nullptr;
  if (!config_.log_json.empty()) {
    json = std::fopen(config_.log_json.c_str(), step_ > 0 ? "a" : "w");
    if (json == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("logging.json: cannot open '",
                                                     config_.log_json,
                                                     "' for writing: ", std::strerror(errno)));
    }
  }
  const auto start = Clock::now();
  double train_seconds = 0;
  double window_seconds = 0;
  int64_t window_tokens = 0;
  const int64_t tokens_per_step =
      static_cast<int64_t>(config_.microbatches) * config_.batch_size * config_.seq_len;
  absl::Status failure;
  while (step_ < config_.steps) {
    const auto step_start = Clock::now();
    absl::StatusOr<StepRecord> r = Step();
    if (!r.ok()) {
      failure = r.status();
      break;
    }
    const double seconds = Seconds(step_start);
    train_seconds += seconds;
    window_seconds += seconds;
    window_tokens += tokens_per_step;
    summary.tokens += tokens_per_step;
    summary.losses.push_back(r->loss);
    const bool last = step_ == config_.steps;
    const bool evaluate =
        !validation_tokens_.empty() &&
        (last || (config_.eval_interval > 0 && step_ % config_.eval_interval == 0));
    if (evaluate) {
      absl::StatusOr<double> val = EvaluateValidation();
      if (!val.ok()) {
        failure = val.status();
        break;
      }
      r->val_loss = *val;
      summary.final_val_loss = *val;
    }
    if (last || evaluate || step_ % config_.log_interval == 0) {
      r->tokens_per_s =
          window_seconds > 0 ? static_cast<double>(window_tokens) / window_seconds : 0;
      r->elapsed_s = Seconds(start);
      window_seconds = 0;
      window_tokens = 0;
      if (on_record) on_record(*r);
      if (json != nullptr) {
        std::fprintf(json, "%s\n", r->ToJson().c_str());
        std::fflush(json);
      }
    }
    if (!config_.checkpoint_dir.empty() &&
        (last || (config_.checkpoint_interval > 0 && step_ % config_.checkpoint_interval == 0))) {
      absl::StatusOr<std::string> path = SaveCheckpoint();
      if (!path.ok()) {
        failure = path.status();
        break;
      }
      summary.last_checkpoint = *path;
    }
  }
  if (json != nullptr) std::fclose(json);
  if (!failure.ok()) return failure;
  summary.steps = step_;
  summary.elapsed_s = Seconds(start);
  summary.tokens_per_s =
      train_seconds > 0 ? static_cast<double>(summary.tokens) / train_seconds : 0;
  if (!summary.losses.empty()) {
    summary.final_loss = summary.losses.back();
    const size_t tail = std::min<size_t>(10, summary.losses.size());
    double sum = 0;
    for (size_t i = summary.losses.size() - tail; i < summary.losses.size(); ++i)
      sum += summary.losses[i];
    summary.tail_loss = sum / static_cast<double>(tail);
  }
  return summary;
}

}  // namespace rackrun::runtime
