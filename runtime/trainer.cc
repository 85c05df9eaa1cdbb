#include "runtime/trainer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/clock.h"
#include "base/status.h"
#include "comm/mpi_channel.h"
#include "jobspec/balancer.h"
#include "jobspec/device.h"
#include "runtime/checkpoint.h"
#include "runtime/job_data.h"
#include "runtime/step_log.h"

namespace rackrun::runtime {
namespace {

// The data order must not be the model's initialisation stream.
constexpr uint64_t kDataSeedSalt = 0xd1b54a32d192ed03ULL;

// The training loop's own state in a checkpoint (section "trainer/state"): what the
// model, optimizer moments and balancer sections do not hold. Stored as eight
// little-endian uint64 words in field order (the layout of every checkpoint so far); words
// 2..7 held the window loader's position before the data position got its own section
// ("data/position", data/loader.h) and are zero since.
struct TrainerCheckpointState {
  uint64_t step = 0;       // optimizer steps done
  uint64_t adam_step = 0;  // AdamW's bias-correction step

  static constexpr size_t kWords = 8;

  std::string Encode() const {
    const uint64_t words[kWords] = {step, adam_step, 0, 0, 0, 0, 0, 0};
    return std::string(reinterpret_cast<const char*>(words), sizeof(words));
  }

  static absl::StatusOr<TrainerCheckpointState> Decode(const Checkpoint& c) {
    const CheckpointSection* s = c.Find("trainer/state");
    uint64_t words[kWords];
    if (s == nullptr || s->payload.size() != sizeof(words)) {
      return absl::DataLossError(
          "checkpoint section 'trainer/state' is missing or has the wrong size");
    }
    std::memcpy(words, s->payload.data(), sizeof(words));
    TrainerCheckpointState state;
    state.step = words[0];
    state.adam_step = words[1];
    return state;
  }
};

// Keeps the lines of the JSON Lines file at `path` whose integer field `key` (the first
// one on the line) is below `limit` and rewrites it atomically when that drops any; a
// missing file is left missing. A line without the field (a torn last line) is dropped.
absl::Status KeepRecordsBelow(const std::string& path, absl::string_view key, int64_t limit) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return absl::OkStatus();
  absl::StatusOr<std::string> text = ReadWholeFile(path, base::FileUse::kJob);
  if (!text.ok()) return text.status();
  const std::string field = absl::StrCat("\"", key, "\": ");
  std::string kept;
  bool dropped = false;
  for (absl::string_view line : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
    const size_t at = line.find(field);
    int64_t value = 0;
    const bool keep = at != absl::string_view::npos && line.back() == '}' &&
                      absl::SimpleAtoi(line.substr(at + field.size(), line.find_first_of(",}", at) -
                                                                          at - field.size()),
                                       &value) &&
                      value < limit;
    if (keep) {
      absl::StrAppend(&kept, line, "\n");
    } else {
      dropped = true;
    }
  }
  if (!dropped && text->size() == kept.size()) return absl::OkStatus();
  return WriteFileAtomically(path, kept, base::FileUse::kJob);
}

// The model's identity in a checkpoint ("spec/model"): the model spec without its compute
// precision, which changes how the same weights are computed with, not what they are (a run
// moves between fp32 on the CPU and bf16 on a GPU by resuming).
std::string ModelIdentity(const rackrun::v1::ModelSpec& model) {
  rackrun::v1::ModelSpec m = model;
  m.clear_precision();
  return m.SerializeAsString();
}

// Expert weights are sharded over the ranks of an expert-parallel job; every other
// parameter is replicated (data-parallel).
bool IsExpertShard(absl::string_view name) { return absl::StrContains(name, ".moe.experts."); }

// Whether the job can run on the `ranks` ranks of `channel`: resources.ranks, then (R > 1)
// that every rank runs the same job, then what expert parallelism needs. Collective with
// R > 1: the spec comparison is an allgather, and only the checks after it are sure to
// fail on every rank alike.
absl::Status CheckJobOnRanks(const rackrun::v1::JobSpec& spec, const TrainConfig& c,
                             comm::DataChannel* channel, int ranks, const TrainerOptions& options) {
  if (spec.resources().ranks() > 0 && spec.resources().ranks() != ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("resources.ranks: the spec asks for ", spec.resources().ranks(),
                     " ranks but the job runs on ", ranks,
                     ranks == 1 ? " (one process; launch with mpirun -np N or srun -n N)" : "",
                     "; set resources.ranks to 0 (as launched) or launch that many ranks"));
  }
  // Experts split over the domains' ranks, domains tiling the ranks.
  if (absl::StatusOr<jobspec::ExpertParallelLayout> layout =
          jobspec::ExpertParallelLayoutOf(spec, ranks);
      !layout.ok()) {
    return layout.status();
  }
  if (ranks == 1) return absl::OkStatus();
  // Every rank must run the same job: compare what shapes the computation.
  const std::string shape =
      absl::StrCat(spec.model().SerializeAsString(), "|", spec.balancer().SerializeAsString(), "|",
                   spec.training().SerializeAsString(), "|", c.batch_size, "|", c.seq_len, "|",
                   spec.parallelism().SerializeAsString());
  const uint32_t mine = Crc32c(shape);
  std::vector<uint32_t> all(static_cast<size_t>(ranks));
  if (absl::Status s = channel->Allgather(&mine, all.data(), 1, comm::DataType::kInt32); !s.ok()) {
    return base::Annotate(s, "comparing job specs across ranks");
  }
  for (int r = 1; r < ranks; ++r) {
    if (all[static_cast<size_t>(r)] != all[0]) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", r,
                       "'s job spec differs from rank 0's in the model, balancer, training or "
                       "batch shape; start every rank with the same spec and --set overrides"));
    }
  }
  if (jobspec::PlannedByCoordinator(spec) && options.plan_source == nullptr) {
    return absl::InvalidArgumentError(
        "balancer.mode: coordinator planning needs the job to run under the rack coordinator "
        "(rackrun submit to rackrun-worker daemons); under mpirun/srun rackrun train plans "
        "in-band: use inband (every rank solves the same plan)");
  }
  if (c.batch_size % ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.batch_size: the global microbatch of ", c.batch_size,
        " sequences cannot be split evenly over ", ranks, " ranks; use a multiple of ", ranks));
  }
  return absl::OkStatus();
}

// AdamW over every parameter of `model`, in the model's order.
std::unique_ptr<AdamW> OptimizerOf(Model<float>& model, const AdamWConfig& config) {
  std::vector<OptimizedTensor> tensors;
  for (const ParamRef<float>& p : model.Parameters()) {
    tensors.push_back({p.name, p.value, p.grad, p.size, DecaysWeight(p.name)});
  }
  return std::make_unique<AdamW>(config, std::move(tensors));
}

// The expert-parallel group of `model` on `channel`, balanced as the spec says. The
// balancer comes from jobspec::BalancerSetupOf, as the coordinator's planner does, so
// in-band and coordinator-mode plans are the same.
absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> CreateExpertParallel(
    const rackrun::v1::JobSpec& spec, comm::DataChannel& channel, comm::DataChannel* replicas,
    Model<float>& model, DeviceEngine* engine, const TrainerOptions& options) {
  absl::StatusOr<jobspec::BalancerSetup> balancer = jobspec::BalancerSetupOf(spec, channel.size());
  if (!balancer.ok()) return balancer.status();
  ExpertParallelOptions ep;
  ep.policy = std::string(balancer->policy->name);
  ep.slots = balancer->domain.slots_per_rank;
  ep.share_slots = balancer->shared_slots;
  ep.planner = balancer->planner;
  // Prepare opens the load trace: a resumed run extends it rather than truncating it.
  ep.replicas = replicas;
  if (jobspec::PlannedByCoordinator(spec)) ep.plan_source = options.plan_source;
  if (engine != nullptr) {
    std::vector<ExpertParallelGroup::Layer> layers = engine->ExpertParallelLayers(ep.share_slots);
    if (layers.empty()) {
      return absl::UnimplementedError(
          "resources.device: this engine offers no expert-parallel MoE layers; run the job on one "
          "rank, or with resources.device: cpu");
    }
    return ExpertParallelGroup::Create(channel, std::move(layers), ep);
  }
  return ExpertParallelGroup::Create(channel, model, ep);
}

// A checkpoint's record of the layout it ran with.
std::string LayoutText(int ranks, int expert_parallel) {
  return absl::StrCat(ranks / expert_parallel, " x ", expert_parallel, " ranks (data_parallel ",
                      ranks / expert_parallel, ", expert_parallel ", expert_parallel, ")");
}

// A checkpoint's training data must come from the tokenizer of this job's data: the ids mean
// nothing to the model otherwise. Both sides must know theirs (data from Megatron without a
// record, or a checkpoint written before tokenizers were recorded, is not compared).
absl::Status CheckCheckpointTokenizer(const Checkpoint& c, const std::string& loaded,
                                      const data::TokenizerInfo& ours) {
  const CheckpointSection* section = c.Find("data/tokenizer");
  if (section == nullptr || ours.kind == "unknown") return absl::OkStatus();
  absl::StatusOr<data::TokenizerInfo> theirs =
      data::TokenizerInfo::FromJson(section->payload, absl::StrCat("checkpoint '", loaded, "'"));
  if (!theirs.ok()) return absl::DataLossError(theirs.status().message());
  if (theirs->kind == "unknown" || theirs->SameTokenizer(ours)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("checkpoint '", loaded, "' was trained on data from tokenizer ",
                   theirs->Describe(), " but this job's data is from ", ours.Describe(),
                   "; resume on data made with the checkpoint's tokenizer"));
}

// Every rank's `mine`, in rank order (collective over `channel`).
absl::StatusOr<std::vector<std::string>> GatherStrings(comm::DataChannel& channel,
                                                       const std::string& mine) {
  const int n = channel.size();
  const int64_t length = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lengths(static_cast<size_t>(n));
  if (absl::Status s = channel.Allgather(&length, lengths.data(), 1, comm::DataType::kInt64);
      !s.ok()) {
    return s;
  }
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  std::string padded = mine;
  padded.resize(static_cast<size_t>(longest));
  std::string all(static_cast<size_t>(longest * n), '\0');
  if (absl::Status s = channel.Allgather(padded.data(), all.data(), longest, comm::DataType::kByte);
      !s.ok()) {
    return s;
  }
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) {
    out.push_back(all.substr(static_cast<size_t>(r * longest),
                             static_cast<size_t>(lengths[static_cast<size_t>(r)])));
  }
  return out;
}

// resources.device, parsed; cuda is refused where this program cannot run it.
absl::StatusOr<jobspec::DeviceSpec> CheckDevice(const rackrun::v1::JobSpec& spec,
                                                const TrainerOptions& options) {
  absl::StatusOr<jobspec::DeviceSpec> device = jobspec::ParseDevice(spec.resources().device());
  if (!device.ok()) return device.status();
  if (device->is_cuda()) {
    if (!options.device_engine) {
      return absl::UnimplementedError(
          absl::StrCat("resources.device: ", device->ToString(),
                       ": this program was built without the GPU engine (no nvcc at build time, or "
                       "RACKRUN_WITH_CUDA=OFF); rebuild with CUDA, or use resources.device: cpu"));
    }
  }
  return device;
}

// The final loss and the mean of the last (up to) 10.
void SummarizeLosses(TrainSummary& summary) {
  if (!summary.losses.empty()) {
    summary.final_loss = summary.losses.back();
    const size_t tail = std::min<size_t>(10, summary.losses.size());
    double sum = 0;
    for (size_t i = summary.losses.size() - tail; i < summary.losses.size(); ++i)
      sum += summary.losses[i];
    summary.tail_loss = sum / static_cast<double>(tail);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const rackrun::v1::JobSpec& spec,
                                                         comm::DataChannel* channel,
                                                         const TrainerOptions& options) {
  std::unique_ptr<Trainer> t(new Trainer());
  t->spec_ = spec;
  t->config_ = TrainConfigFromSpec(spec);
  t->owner_ = options.owner;
  const TrainConfig& c = t->config_;
  const int threads = options.threads >= 0 ? options.threads : c.threads;
  if (threads > 0) omp_set_num_threads(threads);
  const int ranks = channel != nullptr ? channel->size() : 1;
  if (ranks > 1) t->channel_ = channel;
  if (absl::Status s = CheckJobOnRanks(spec, c, channel, ranks, options); !s.ok()) return s;
  // resources.device: cuda is refused before anything is allocated where this program
  // cannot run it (the engine is created once the host model exists, below).
  absl::StatusOr<jobspec::DeviceSpec> device = CheckDevice(spec, options);
  if (!device.ok()) return device.status();
  t->spec_.mutable_resources()->set_ranks(ranks);
  absl::StatusOr<jobspec::ExpertParallelLayout> layout =
      jobspec::ExpertParallelLayoutOf(spec, ranks);
  if (!layout.ok()) return layout.status();  // checked above; kept for the compiler's sake
  t->data_parallel_ = layout->data_parallel;
  if (layout->data_parallel > 1) {
    // Domain d = ranks d*G .. d*G+G-1; the shard channel joins equal in-domain indices.
    const int g = layout->expert_parallel;
    absl::StatusOr<std::unique_ptr<comm::DataChannel>> domain =
        channel->Split(t->rank() / g, t->rank());
    if (!domain.ok()) return base::Annotate(domain.status(), "making the expert-parallel domains");
    t->domain_channel_ = *std::move(domain);
    absl::StatusOr<std::unique_ptr<comm::DataChannel>> shard =
        channel->Split(t->rank() % g, t->rank());
    if (!shard.ok()) return base::Annotate(shard.status(), "joining the domains' expert shards");
    t->shard_channel_ = *std::move(shard);
  }

  ModelConfig mc = ModelConfigFromSpec(spec);
  mc.expert_rank = t->domain_rank();
  mc.expert_ranks = t->expert_parallel_degree();
  absl::StatusOr<JobData> data = OpenJobData(spec, c, c.seed ^ kDataSeedSalt, &mc.vocab);
  if (!data.ok()) return data.status();
  t->spec_.mutable_model()->set_vocab(mc.vocab);  // a 0 came from the data
  t->train_loader_ = std::move(data->train);
  t->validation_loader_ = std::move(data->validation);
  t->train_entropy_ = t->train_loader_->unigram_entropy();

  absl::StatusOr<std::unique_ptr<Model<float>>> model = Model<float>::Create(mc, c.seed);
  if (!model.ok()) {
    return model.status();  // already names the field (model.<field>: ...)
  }
  t->model_ = std::move(*model);
  t->adam_ = OptimizerOf(*t->model_, c.adamw);
  t->buffers_ = t->model_->Buffers();
  t->params_ = t->model_->Parameters();
  if (device->is_cuda()) {
    absl::StatusOr<std::unique_ptr<DeviceEngine>> engine = options.device_engine(
        DeviceEngineSetup{&t->spec_, *device, comm::LauncherLocalRank(), t->model_.get(), c.adamw});
    if (!engine.ok()) return engine.status();
    t->engine_ = *std::move(engine);
  }
  if (ranks == 1) return t;

  // Expert parallelism: dense gradients are all-reduced in one packed buffer, expert
  // shards stay with their master.
  size_t dense_floats = 0;
  for (size_t i = 0; i < t->adam_->tensors().size(); ++i) {
    const OptimizedTensor& o = t->adam_->tensors()[i];
    if (IsExpertShard(o.name)) {
      t->experts_.push_back(i);
    } else {
      t->dense_.push_back(i);
      dense_floats += static_cast<size_t>(o.size);
    }
  }
  // On GPUs over channels that take device buffers the gradients stay on the devices.
  t->device_gradients_ =
      t->engine_ != nullptr && t->engine_->reduces_gradients_on_device() &&
      channel->takes_device_buffers() &&
      (t->shard_channel_ == nullptr || t->shard_channel_->takes_device_buffers());
  if (!t->device_gradients_) {
    t->dense_grads_.resize(dense_floats);
    if (t->shard_channel_ != nullptr) {
      size_t expert_floats = 0;
      for (const size_t i : t->experts_) {
        expert_floats += static_cast<size_t>(t->adam_->tensors()[i].size);
      }
      t->expert_grads_.resize(expert_floats);
    }
  }
  comm::DataChannel& ep_channel = t->domain_channel_ != nullptr ? *t->domain_channel_ : *channel;
  // On a GPU the engine's MoE layers take the executors (host-staged expert parallelism).
  absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> group = CreateExpertParallel(
      spec, ep_channel, t->shard_channel_.get(), *t->model_, t->engine_.get(), options);
  if (!group.ok()) return group.status();
  t->ep_ = *std::move(group);
  return t;
}

int64_t Trainer::parameter_count() const {
  int64_t n = 0;
  for (const OptimizedTensor& t : adam_->tensors()) {
    n += IsExpertShard(t.name) ? t.size * expert_parallel_degree() : t.size;
  }
  return n;
}

absl::StatusOr<double> Trainer::NextBatch(data::Loader& loader) {
  // Every target of a sample is counted (the loader masks none), so a rank's share is its
  // share of the rows; it reads only those, and the stream advances by the global batch.
  const int rows = config_.batch_size / ranks();
  if (absl::Status s = loader.Next(rank() * rows, rows, batch_); !s.ok()) return s;
  return static_cast<double>(rows) / static_cast<double>(config_.batch_size);
}

absl::Status Trainer::AllReducePacked(comm::DataChannel& channel, const std::vector<size_t>& which,
                                      std::vector<float>& packed, absl::string_view what) {
  const auto annotate = [&](const absl::Status& s) {
    return base::Annotate(s, absl::StrCat("all-reducing ", what, " at step ", step_ + 1));
  };
  if (device_gradients_) {
    absl::StatusOr<std::span<float>> on_device = engine_->PackGradients(which);
    if (!on_device.ok()) return annotate(on_device.status());
    if (absl::Status s = channel.AllReduce(on_device->data(), on_device->data(),
                                           static_cast<int64_t>(on_device->size()),
                                           comm::DataType::kFloat32, comm::ReduceOp::kSum);
        !s.ok()) {
      return annotate(s);
    }
    absl::Status s = engine_->UnpackGradients(which);
    return s.ok() ? s : annotate(s);
  }
  const std::vector<OptimizedTensor>& tensors = adam_->tensors();
  size_t k = 0;
  for (const size_t i : which) {
    const OptimizedTensor& t = tensors[i];
    std::memcpy(packed.data() + k, t.grad, static_cast<size_t>(t.size) * sizeof(float));
    k += static_cast<size_t>(t.size);
  }
  if (absl::Status s =
          channel.AllReduce(packed.data(), packed.data(), static_cast<int64_t>(packed.size()),
                            comm::DataType::kFloat32, comm::ReduceOp::kSum);
      !s.ok()) {
    return annotate(s);
  }
  k = 0;
  for (const size_t i : which) {
    const OptimizedTensor& t = tensors[i];
    std::memcpy(params_[i].grad, packed.data() + k, static_cast<size_t>(t.size) * sizeof(float));
    k += static_cast<size_t>(t.size);
  }
  return absl::OkStatus();
}

absl::Status Trainer::AllReduceGradients(StepRecord& r) {
  const base::Stopwatch dense_clock;
  if (absl::Status s = AllReducePacked(*channel_, dense_, dense_grads_, "dense gradients");
      !s.ok()) {
    return s;
  }
  r.dense_allreduce_s = dense_clock.Seconds();
  if (shard_channel_ == nullptr) return absl::OkStatus();
  // Each domain's masters hold the gradient of its ranks' rows: the sum over the domains
  // is the global microbatch's.
  const base::Stopwatch expert_clock;
  absl::Status s =
      AllReducePacked(*shard_channel_, experts_, expert_grads_, "expert gradients across domains");
  r.expert_allreduce_s = expert_clock.Seconds();
  return s;
}

absl::StatusOr<double> Trainer::GradNorm() {
  if (channel_ == nullptr) {
    if (engine_ != nullptr) return engine_->GradNorm(config_.grad_clip);
    return GlobalGradNorm(adam_->tensors());
  }
  const std::vector<OptimizedTensor>& tensors = adam_->tensors();
  // Gradients on the devices: each tensor's sum of squares from its engine.
  std::vector<double> on_device;
  if (device_gradients_) {
    absl::StatusOr<std::vector<double>> got = engine_->GradSquares();
    if (!got.ok()) return base::Annotate(got.status(), "measuring the gradients on the GPU");
    if (got->size() != tensors.size()) {
      return absl::InternalError(
          absl::StrCat("the GPU engine measured ", got->size(), " gradients of ", tensors.size()));
    }
    on_device = *std::move(got);
  }
  const auto squares = [&](const std::vector<size_t>& which) {
    double sum = 0;
    for (const size_t i : which) {
      if (device_gradients_) {
        sum += on_device[i];
        continue;
      }
      const OptimizedTensor& t = tensors[i];
      for (int64_t j = 0; j < t.size; ++j) sum += static_cast<double>(t.grad[j]) * t.grad[j];
    }
    return sum;
  };
  // Dense gradients are identical on every rank; expert shards are summed over a domain's
  // ranks (every domain holds the same expert gradients).
  double experts = squares(experts_);
  comm::DataChannel& domain = domain_channel_ != nullptr ? *domain_channel_ : *channel_;
  if (absl::Status s =
          domain.AllReduce(&experts, &experts, 1, comm::DataType::kFloat64, comm::ReduceOp::kSum);
      !s.ok()) {
    return base::Annotate(s, absl::StrCat("all-reducing the gradient norm at step ", step_ + 1));
  }
  return std::sqrt(squares(dense_) + experts);
}

absl::Status Trainer::GatherDomainStats(StepRecord& r) {
  // One block per domain that only the domain's first rank fills (the figures are the same
  // on every rank of a domain), summed over all ranks: everyone gets every domain's. One
  // domain: every rank has it already, no collective.
  const ExpertParallelStats& st = ep_->stats();
  const size_t layers = st.layers.size();
  const size_t g = static_cast<size_t>(expert_parallel_degree());
  const size_t block = 2 * layers + 2 * g;
  std::vector<double> sums(block * static_cast<size_t>(data_parallel_), 0.0);
  if (domain_rank() == 0 || data_parallel_ == 1) {
    double* b = sums.data() + block * static_cast<size_t>(domain());
    for (size_t i = 0; i < layers; ++i) {
      const double n = static_cast<double>(std::max<int64_t>(st.layers[i].microbatches, 1));
      b[i] = st.layers[i].imbalance_before / n;
      b[layers + i] = st.layers[i].imbalance_after / n;
    }
    for (size_t i = 0; i < g && i < st.rank_tokens_before.size(); ++i) {
      b[2 * layers + i] = static_cast<double>(st.rank_tokens_before[i]);
    }
    for (size_t i = 0; i < g && i < st.rank_tokens_after.size(); ++i) {
      b[2 * layers + g + i] = static_cast<double>(st.rank_tokens_after[i]);
    }
  }
  if (data_parallel_ > 1) {
    const base::Stopwatch clock;
    if (absl::Status s =
            channel_->AllReduce(sums.data(), sums.data(), static_cast<int64_t>(sums.size()),
                                comm::DataType::kFloat64, comm::ReduceOp::kSum);
        !s.ok()) {
      return base::Annotate(
          s, absl::StrCat("all-reducing the domains' balancing figures at step ", step_ + 1));
    }
    r.domain_stats_s = clock.Seconds();
  }
  r.expert_parallel = static_cast<int>(g);
  for (int d = 0; d < data_parallel_; ++d) {
    const double* b = sums.data() + block * static_cast<size_t>(d);
    StepRecord::Domain dom;
    dom.imbalance_before.assign(b, b + layers);
    dom.imbalance_after.assign(b + layers, b + 2 * layers);
    dom.rank_tokens_before.assign(b + 2 * layers, b + 2 * layers + g);
    dom.rank_tokens_after.assign(b + 2 * layers + g, b + block);
    r.domains.push_back(std::move(dom));
  }
  return absl::OkStatus();
}

const std::vector<std::vector<int64_t>>& Trainer::ExpertCounts() const {
  return engine_ != nullptr ? engine_->expert_counts() : model_->expert_counts();
}

double Trainer::AuxLoss() const {
  return engine_ != nullptr ? engine_->aux_loss() : model_->aux_loss();
}

absl::Status Trainer::RecordLoads(int64_t microbatch) {
  const std::vector<std::vector<int64_t>>& counts = ExpertCounts();
  for (size_t layer = 0; layer < counts.size(); ++layer) {
    planner::TraceEntry entry;
    entry.microbatch = microbatch;
    entry.layer = static_cast<int>(layer);
    entry.loads = planner::LoadMatrix(1, static_cast<int>(counts[layer].size()));
    entry.loads.counts = counts[layer];
    if (absl::Status s = trace_->Append(entry); !s.ok()) {
      return base::Annotate(s, "logging.load_trace");
    }
  }
  return absl::OkStatus();
}

void Trainer::RecordBalanceStats(StepRecord& r) const {
  if (ep_ != nullptr) {
    const ExpertParallelStats& st = ep_->stats();
    for (const ExpertParallelStats::Layer& l : st.layers) {
      const double n = static_cast<double>(std::max<int64_t>(l.microbatches, 1));
      r.rank_imbalance_before.push_back(l.imbalance_before / n);
      r.rank_imbalance_after.push_back(l.imbalance_after / n);
      r.replicas += static_cast<double>(l.replicas) / n;
    }
    if (!st.layers.empty()) r.replicas /= static_cast<double>(st.layers.size());
    r.plan_s = st.plan_s;
    r.plan_exchange_s = st.plan_exchange_s;
    r.fanout_s = st.fanout_s;
    r.dispatch_s = st.dispatch_s;
    r.reduce_s = st.reduce_s;
  }
  for (const std::vector<int64_t>& counts : ExpertCounts()) {
    int64_t total = 0, max = 0;
    for (const int64_t n : counts) {
      total += n;
      max = std::max(max, n);
    }
    const double mean =
        counts.empty() ? 0 : static_cast<double>(total) / static_cast<double>(counts.size());
    r.expert_load_max_over_mean.push_back(mean > 0 ? static_cast<double>(max) / mean : 0);
  }
}

absl::StatusOr<StepRecord> Trainer::Step() {
  StepRecord r;
  const base::Stopwatch step_clock;
  if (engine_ != nullptr) {
    if (absl::Status s = engine_->ZeroGrad(); !s.ok()) return s;
  } else {
    model_->ZeroGrad();
  }
  if (ep_ != nullptr) ep_->ResetStats();
  const int micro = config_.microbatches;
  double loss_sum = 0;
  double aux_sum = 0;
  for (int m = 0; m < micro; ++m) {
    // This rank's share of the global microbatch's counted targets: the ranks' scaled
    // gradients sum to the gradient of the global mean loss.
    SetPhase(TrainPhase::kData);
    absl::StatusOr<double> next = NextBatch(*train_loader_);
    if (!next.ok()) return next.status();
    const double share = *next;
    if (ep_ != nullptr) ep_->BeginMicrobatch(microbatch_, /*training=*/true);
    SetPhase(TrainPhase::kForwardBackward);
    const float grad_scale = static_cast<float>(share / micro);
    absl::StatusOr<double> loss =
        engine_ != nullptr ? engine_->ForwardBackward(batch_.inputs, batch_.targets, batch_.batch,
                                                      batch_.segment_starts, grad_scale)
                           : model_->ForwardBackward(batch_.inputs, batch_.targets, batch_.batch,
                                                     batch_.segment_starts, grad_scale);
    if (!loss.ok()) return loss.status();
    if (ep_ != nullptr) {
      if (absl::Status s = ep_->FinishMicrobatch(); !s.ok()) return s;
    }
    if (trace_.has_value()) {
      if (absl::Status s = RecordLoads(microbatch_); !s.ok()) return s;
    }
    ++microbatch_;
    loss_sum += *loss * share;
    aux_sum += AuxLoss() * share;
  }
  SetPhase(TrainPhase::kReduce);
  if (channel_ != nullptr) {
    // Several ranks on GPUs: the gradients are reduced, measured and clipped on the host,
    // unless the channels take them where they are.
    if (engine_ != nullptr && !device_gradients_) {
      if (absl::Status s = engine_->StoreGradients(*model_); !s.ok()) return s;
    }
    if (absl::Status s = AllReduceGradients(r); !s.ok()) return s;
    double sums[2] = {loss_sum, aux_sum};
    if (absl::Status s =
            channel_->AllReduce(sums, sums, 2, comm::DataType::kFloat64, comm::ReduceOp::kSum);
        !s.ok()) {
      return base::Annotate(s, absl::StrCat("all-reducing the loss at step ", step_ + 1));
    }
    loss_sum = sums[0];
    aux_sum = sums[1];
    if (ep_ != nullptr) {
      if (absl::Status s = GatherDomainStats(r); !s.ok()) return s;
    }
  }
  r.loss = loss_sum / micro;
  r.aux_loss = aux_sum / micro;
  if (!std::isfinite(r.loss)) {
    return absl::FailedPreconditionError(
        absl::StrCat("loss is ", r.loss, " at step ", step_ + 1,
                     "; lower training.lr or raise training.warmup_steps"));
  }
  absl::StatusOr<double> norm = GradNorm();
  if (!norm.ok()) return norm.status();
  r.grad_norm = *norm;
  const double clip = config_.grad_clip;
  const double grad_scale = (clip > 0 && r.grad_norm > clip) ? clip / r.grad_norm : 1.0;
  r.lr = config_.schedule.At(step_);
  SetPhase(TrainPhase::kOptimizer);
  if (absl::Status s = OptimizerStep(r.lr, grad_scale); !s.ok()) return s;
  ++step_;
  steps_done_.store(step_, std::memory_order_relaxed);
  r.step = step_;
  r.ranks = ranks();
  RecordBalanceStats(r);
  const double seconds = step_clock.Seconds();
  r.tokens_per_s =
      seconds > 0 ? static_cast<double>(micro) * config_.batch_size * config_.seq_len / seconds : 0;
  return r;
}

absl::Status Trainer::OptimizerStep(double lr, double grad_scale) {
  if (engine_ != nullptr) {
    if (device_gradients_) {
      // Reduced on the devices: the host's clipping factor applies there.
      if (absl::Status s = engine_->ScaleGradients(grad_scale); !s.ok()) return s;
    } else if (channel_ != nullptr) {
      // The host's reduced gradients, clipped as the CPU engine's AdamW scales them.
      if (grad_scale != 1.0) {
        const float scale = static_cast<float>(grad_scale);
        for (const ParamRef<float>& p : params_) {
          for (int64_t j = 0; j < p.size; ++j) p.grad[j] *= scale;
        }
      }
      if (absl::Status s = engine_->LoadGradients(*model_); !s.ok()) return s;
    }
    // One rank: the device applies the clipping factor GradNorm kept there.
    if (absl::Status s = engine_->OptimizerStep(lr); !s.ok()) return s;
  } else {
    adam_->Step(lr, grad_scale);
  }
  return ep_ != nullptr ? ep_->WeightsChanged() : absl::OkStatus();
}

absl::StatusOr<double> Trainer::EvaluateValidation() {
  if (validation_loader_ == nullptr) {
    return absl::FailedPreconditionError("the job has no validation data (data.validation)");
  }
  data::Loader& loader = *validation_loader_;
  // The same microbatches every time: from the start of the (unshuffled) stream.
  if (absl::Status s =
          loader.Restore({.samples = 0, .drawn = std::vector<uint64_t>(loader.datasets(), 0)});
      !s.ok()) {
    return s;
  }
  // Never more batches than one pass holds, so every batch is a distinct window set.
  const int64_t per_pass = std::max<int64_t>(1, loader.windows_per_epoch() / config_.batch_size);
  const int64_t batches = std::min<int64_t>(config_.eval_batches, per_pass);
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    absl::StatusOr<double> next = NextBatch(loader);
    if (!next.ok()) return next.status();
    const double share = *next;
    if (ep_ != nullptr) ep_->BeginMicrobatch(i, /*training=*/false);
    absl::StatusOr<double> loss =
        engine_ != nullptr
            ? engine_->Evaluate(batch_.inputs, batch_.targets, batch_.batch, batch_.segment_starts)
            : model_->Evaluate(batch_.inputs, batch_.targets, batch_.batch, batch_.segment_starts);
    if (!loss.ok()) return loss.status();
    sum += *loss * share;
  }
  if (channel_ != nullptr) {
    if (absl::Status s =
            channel_->AllReduce(&sum, &sum, 1, comm::DataType::kFloat64, comm::ReduceOp::kSum);
        !s.ok()) {
      return base::Annotate(s, "all-reducing the validation loss");
    }
  }
  return sum / static_cast<double>(batches);
}

absl::StatusOr<std::string> Trainer::SaveCheckpoint() {
  if (config_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("checkpoint.dir is not set");
  }
  if (engine_ != nullptr) {
    // The device holds the state: the host model and AdamW are the checkpoint's view of it.
    if (absl::Status s = engine_->StoreState(*model_, *adam_); !s.ok()) {
      return base::Annotate(s, "copying the GPU's state for a checkpoint");
    }
  }
  Checkpoint c;
  c.step = step_;
  TrainerCheckpointState state;
  state.step = static_cast<uint64_t>(step_);
  state.adam_step = static_cast<uint64_t>(adam_->step());
  c.sections.push_back({"trainer/state", state.Encode()});
  c.sections.push_back({"data/position", train_loader_->SavePosition()});
  c.sections.push_back({"data/tokenizer", train_loader_->tokenizer().ToJson()});
  c.sections.push_back({"spec/model", ModelIdentity(spec_.model())});
  c.sections.push_back({"spec/json", jobspec::JobSpecToJson(spec_)});
  const std::vector<OptimizedTensor>& tensors = adam_->tensors();
  // Expert shards are gathered (rank order = expert order) into the single-process layout,
  // so a checkpoint resumes on any number of ranks.
  std::vector<float> full;
  const bool lead = rank() == 0;
  const auto add = [&](const std::string& name, const OptimizedTensor& t,
                       std::span<const float> local) -> absl::Status {
    if (channel_ == nullptr || !IsExpertShard(t.name)) {
      if (lead) c.sections.push_back({name, PackFloats(local)});
      return absl::OkStatus();
    }
    // Every domain holds the same experts: each gathers its own, rank 0 keeps domain 0's.
    comm::DataChannel& domain = domain_channel_ != nullptr ? *domain_channel_ : *channel_;
    full.resize(local.size() * static_cast<size_t>(expert_parallel_degree()));
    if (absl::Status s =
            domain.Allgather(local.data(), full.data(), static_cast<int64_t>(local.size()),
                             comm::DataType::kFloat32);
        !s.ok()) {
      return base::Annotate(s, "gathering expert shards for a checkpoint");
    }
    if (lead) c.sections.push_back({name, PackFloats(full)});
    return absl::OkStatus();
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const OptimizedTensor& t = tensors[i];
    const std::pair<std::string, std::span<const float>> parts[] = {
        {"param/" + t.name, {t.value, static_cast<size_t>(t.size)}},
        {"adam_m/" + t.name, adam_->first_moment(i)},
        {"adam_v/" + t.name, adam_->second_moment(i)}};
    for (const auto& [name, values] : parts) {
      if (absl::Status s = add(name, t, values); !s.ok()) return s;
    }
  }
  for (const ParamRef<float>& b : buffers_) {
    c.sections.push_back({"buffer/" + b.name, PackFloats({b.value, static_cast<size_t>(b.size)})});
  }
  // The layout it ran with (a resume on another one reshards the experts).
  c.sections.push_back({"parallelism/layout", LayoutText(ranks(), expert_parallel_degree())});
  // The balancer's history (EPLB), the same on every rank of a domain: a resumed run plans
  // as the uninterrupted one would. Domain 0's under "balancer/state" (as with one domain),
  // domain d's under "balancer/state/domain<d>", gathered over the shard channel.
  if (ep_ != nullptr) {
    absl::StatusOr<std::string> mine = ep_->SaveState();
    if (!mine.ok()) return base::Annotate(mine.status(), "saving the balancer state");
    if (shard_channel_ == nullptr) {
      c.sections.push_back({"balancer/state", *std::move(mine)});
    } else {
      absl::StatusOr<std::vector<std::string>> states = GatherStrings(*shard_channel_, *mine);
      if (!states.ok()) return base::Annotate(states.status(), "gathering balancer states");
      c.sections.push_back({"balancer/state", (*states)[0]});
      for (size_t d = 1; d < states->size(); ++d) {
        c.sections.push_back({absl::StrCat("balancer/state/domain", d), (*states)[d]});
      }
    }
  }
  absl::StatusOr<std::string> path;
  if (lead) {
    path = ::rackrun::runtime::SaveCheckpoint(config_.checkpoint_dir, c, config_.checkpoint_keep);
  }
  if (channel_ != nullptr) {
    // Every rank learns whether rank 0's write succeeded, so none trains on past a lost
    // checkpoint.
    int32_t written = lead && path.ok() ? 1 : 0;
    if (absl::Status s = channel_->Broadcast(&written, 1, comm::DataType::kInt32, 0); !s.ok()) {
      return base::Annotate(s, "sharing the checkpoint result");
    }
    if (!lead) {
      if (written == 0) {
        return absl::DataLossError(absl::StrCat("rank 0 failed to write the checkpoint of step ",
                                                step_, "; see rank 0's error"));
      }
      return std::string();
    }
  }
  return path;
}

absl::Status Trainer::RestoreTensors(const Checkpoint& c, const std::string& loaded) {
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
      const CheckpointSection* s = c.Find(name);
      if (s == nullptr) return missing(name);
      if (channel_ != nullptr && IsExpertShard(t.name)) {
        // The checkpoint holds every expert; this rank takes its domain index's shard.
        std::vector<float> full(out.size() * static_cast<size_t>(expert_parallel_degree()));
        if (absl::Status st = UnpackFloats(*s, full); !st.ok()) return st;
        std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(out.size()) * domain_rank(),
                    out.size(), out.begin());
        continue;
      }
      if (absl::Status st = UnpackFloats(*s, out); !st.ok()) return st;
    }
  }
  for (const ParamRef<float>& b : buffers_) {
    const CheckpointSection* s = c.Find("buffer/" + b.name);
    if (s == nullptr) return missing("buffer/" + b.name);
    if (absl::Status st = UnpackFloats(*s, {b.value, static_cast<size_t>(b.size)}); !st.ok())
      return st;
  }
  return absl::OkStatus();
}

absl::Status Trainer::Resume(const std::string& path) {
  resume_note_.clear();
  std::string loaded;
  absl::StatusOr<Checkpoint> c = LoadCheckpointForResume(path, &loaded);
  if (!c.ok()) return c.status();
  const CheckpointSection* model_spec = c->Find("spec/model");
  rackrun::v1::ModelSpec saved_model;
  if (model_spec == nullptr || !saved_model.ParseFromString(model_spec->payload) ||
      ModelIdentity(saved_model) != ModelIdentity(spec_.model())) {
    rackrun::v1::ModelSpec theirs;
    if (model_spec != nullptr) theirs.ParseFromString(model_spec->payload);
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint '", loaded, "' was written for a different model (",
                     theirs.ShortDebugString(), ") than this spec's (",
                     spec_.model().ShortDebugString(), "); resume with the spec that wrote it"));
  }
  absl::StatusOr<TrainerCheckpointState> state = TrainerCheckpointState::Decode(*c);
  if (!state.ok()) return state.status();
  if (absl::Status s = CheckCheckpointTokenizer(*c, loaded, train_loader_->tokenizer()); !s.ok()) {
    return s;
  }
  if (absl::Status s = RestoreTensors(*c, loaded); !s.ok()) return s;
  const std::string layout = LayoutText(ranks(), expert_parallel_degree());
  const CheckpointSection* saved_layout = c->Find("parallelism/layout");
  // The checkpoint holds every expert once: any layout takes its shards from it.
  const std::string layout_note = saved_layout != nullptr && saved_layout->payload != layout
                                      ? absl::StrCat("checkpoint of ", saved_layout->payload,
                                                     " resumed on ", layout, " (experts resharded)")
                                      : std::string();
  const std::string balancer_section = domain() == 0
                                           ? std::string("balancer/state")
                                           : absl::StrCat("balancer/state/domain", domain());
  const CheckpointSection* b = c->Find(balancer_section);
  if (b == nullptr && ep_ != nullptr && c->Find("balancer/state") != nullptr) {
    if (!resume_note_.empty()) absl::StrAppend(&resume_note_, "; ");
    absl::StrAppend(&resume_note_, "balancer history not restored in domain ", domain(),
                    " (the checkpoint was written with fewer domains); the "
                    "balancer starts with a fresh history");
  }
  if (b != nullptr && ep_ != nullptr) {
    absl::Status s = ep_->RestoreState(b->payload);
    if (s.code() == absl::StatusCode::kFailedPrecondition) {
      // Resuming on another rank count or with other balancer settings: the planner
      // starts with a fresh history; results are unaffected, placements may differ.
      if (!resume_note_.empty()) absl::StrAppend(&resume_note_, "; ");
      absl::StrAppend(&resume_note_, "balancer history not restored (", s.message(),
                      "); the balancer starts with a fresh history");
    } else if (!s.ok()) {
      return absl::DataLossError(absl::StrCat("checkpoint '", loaded, "': ", s.message()));
    }
  }
  if (const CheckpointSection* position = c->Find("data/position"); position != nullptr) {
    if (absl::Status s = train_loader_->RestorePosition(position->payload); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("checkpoint '", loaded, "': ", s.message()));
    }
  } else {
    if (!resume_note_.empty()) absl::StrAppend(&resume_note_, "; ");
    absl::StrAppend(&resume_note_,
                    "the checkpoint holds no data position (imported weights, or written before "
                    "rackrun recorded one): the training data starts from its first sample");
  }
  if (!layout_note.empty()) {
    if (!resume_note_.empty()) absl::StrAppend(&resume_note_, "; ");
    absl::StrAppend(&resume_note_, layout_note);
  }
  step_ = static_cast<int64_t>(state->step);
  resumed_from_ = loaded;
  resumed_checksum_ = c->checksum;
  steps_done_.store(step_, std::memory_order_relaxed);
  microbatch_ = step_ * config_.microbatches;
  adam_->set_step(static_cast<int64_t>(state->adam_step));
  if (engine_ != nullptr) {
    if (absl::Status s = engine_->LoadState(*model_, *adam_); !s.ok()) {
      return base::Annotate(s, "copying the resumed state to the GPU");
    }
  }
  return absl::OkStatus();
}

std::string TrainerStateSection(int64_t step, int64_t adam_step) {
  TrainerCheckpointState state;
  state.step = static_cast<uint64_t>(step);
  state.adam_step = static_cast<uint64_t>(adam_step);
  return state.Encode();
}

const char* TrainPhaseName(TrainPhase phase) {
  switch (phase) {
    case TrainPhase::kIdle:
      return "idle";
    case TrainPhase::kAgree:
      return "agree";
    case TrainPhase::kData:
      return "data";
    case TrainPhase::kForwardBackward:
      return "forward_backward";
    case TrainPhase::kReduce:
      return "reduce";
    case TrainPhase::kOptimizer:
      return "optimizer";
    case TrainPhase::kEvaluate:
      return "evaluate";
    case TrainPhase::kCheckpoint:
      return "checkpoint";
  }
  return "unknown";
}

void Trainer::RequestStop(StopReason reason) {
  int current = stop_requested_.load();
  // A drain (checkpoint, then stop) outranks a cancel.
  while (static_cast<int>(reason) > current &&
         !stop_requested_.compare_exchange_weak(current, static_cast<int>(reason))) {
  }
}

absl::StatusOr<StopReason> Trainer::AgreeOnStop() {
  const int local = stop_requested_.load();
  if (channel_ == nullptr) return static_cast<StopReason>(local);
  SetPhase(TrainPhase::kAgree);
  int32_t votes[2] = {local == static_cast<int>(StopReason::kCancel) ? 1 : 0,
                      local == static_cast<int>(StopReason::kDrain) ? 1 : 0};
  if (absl::Status s =
          channel_->AllReduce(votes, votes, 2, comm::DataType::kInt32, comm::ReduceOp::kSum);
      !s.ok()) {
    return base::Annotate(s, absl::StrCat("agreeing whether to stop before step ", step_ + 1));
  }
  if (votes[1] > 0) return StopReason::kDrain;
  if (votes[0] > 0) return StopReason::kCancel;
  return StopReason::kNone;
}

absl::Status Trainer::AgreeOnResumeState() {
  if (channel_ == nullptr) return absl::OkStatus();
  const int64_t mine[2] = {step_, static_cast<int64_t>(resumed_checksum_)};
  std::vector<int64_t> all(2 * static_cast<size_t>(ranks()));
  if (absl::Status s = channel_->Allgather(mine, all.data(), 2, comm::DataType::kInt64); !s.ok()) {
    return base::Annotate(s, "comparing the ranks' resume states");
  }
  // Group the ranks by state, in rank order: "rank 0 resumed step 4 (checkpoint crc32c
  // 0x...); rank 1 starts fresh (step 0)".
  std::vector<std::pair<int64_t, int64_t>> states;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < ranks(); ++r) {
    const std::pair<int64_t, int64_t> state = {all[2 * static_cast<size_t>(r)],
                                               all[2 * static_cast<size_t>(r) + 1]};
    const auto at = std::find(states.begin(), states.end(), state);
    if (at == states.end()) {
      states.push_back(state);
      members.push_back({r});
    } else {
      members[static_cast<size_t>(at - states.begin())].push_back(r);
    }
  }
  if (states.size() == 1) return absl::OkStatus();
  std::vector<std::string> parts;
  for (size_t i = 0; i < states.size(); ++i) {
    const auto [step, crc] = states[i];
    parts.push_back(absl::StrCat(
        members[i].size() > 1 ? "ranks " : "rank ", absl::StrJoin(members[i], ","), " ",
        step == 0 && crc == 0
            ? std::string(members[i].size() > 1 ? "start fresh (step 0)" : "starts fresh (step 0)")
            : absl::StrFormat("resumed step %d (checkpoint crc32c 0x%08x)", step, crc)));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("the ranks disagree on the state to start from: ", absl::StrJoin(parts, "; "),
                   "; start every rank with the same --resume (or none)"));
}

absl::Status Trainer::PrepareOutputs() {
  notes_.clear();
  if (!config_.checkpoint_dir.empty()) {
    CheckpointFolderRun run;
    run.resumed_from = resumed_from_;
    run.resumed_step = step_;
    run.start_over = config_.checkpoint_start_over;
    run.owner = owner_;
    absl::StatusOr<CheckpointFolderClaim> claim =
        ClaimCheckpointFolder(config_.checkpoint_dir, run);
    if (!claim.ok()) return claim.status();
    folder_lock_.emplace(std::move(claim->lock));
    notes_ = std::move(claim->notes);
  }
  // A resumed run's logs hold what its checkpoint's run logged, possibly beyond the resume
  // step (the steps after the last checkpoint): cut them back, then extend them.
  const bool resumed = step_ > 0;
  if (!config_.log_json.empty()) {
    if (resumed) {
      if (absl::Status s = KeepRecordsBelow(config_.log_json, "step", step_ + 1); !s.ok()) {
        return base::Annotate(s, "logging.json");
      }
    }
    absl::StatusOr<std::unique_ptr<StepLog>> log =
        StepLog::Create(config_.log_interval, config_.steps, config_.log_json, resumed,
                        /*on_record=*/{});
    if (!log.ok()) return log.status();
    json_log_ = *std::move(log);
  }
  if (!config_.load_trace.empty()) {
    if (resumed) {
      if (absl::Status s = KeepRecordsBelow(config_.load_trace, "microbatch", microbatch_);
          !s.ok()) {
        return base::Annotate(s, "logging.load_trace");
      }
    }
    absl::StatusOr<planner::TraceWriter> w =
        planner::TraceWriter::Open(config_.load_trace, resumed);
    if (!w.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("logging.load_trace: ", w.status().message()));
    }
    if (ep_ != nullptr) {
      ep_->AttachTrace(*std::move(w));
    } else {
      trace_.emplace(*std::move(w));
    }
  }
  return absl::OkStatus();
}

absl::Status Trainer::Prepare() {
  prepared_ = false;
  folder_lock_.reset();
  json_log_.reset();
  if (absl::Status s = AgreeOnResumeState(); !s.ok()) return s;
  absl::Status outputs = rank() == 0 ? PrepareOutputs() : absl::OkStatus();
  if (channel_ != nullptr) {
    // Rank 0's result (its message) becomes every rank's.
    std::string message(outputs.message());
    int64_t length =
        rank() == 0 ? (outputs.ok() ? 0 : static_cast<int64_t>(message.size()) + 1) : 0;
    if (absl::Status s = channel_->Broadcast(&length, 1, comm::DataType::kInt64, 0); !s.ok()) {
      return base::Annotate(s, "sharing rank 0's output checks");
    }
    if (length > 0) {
      message.resize(static_cast<size_t>(length));
      if (absl::Status s = channel_->Broadcast(message.data(), length, comm::DataType::kByte, 0);
          !s.ok()) {
        return base::Annotate(s, "sharing rank 0's output checks");
      }
      message.pop_back();
      if (rank() != 0) {
        outputs = absl::FailedPreconditionError(absl::StrCat("rank 0 refused to start: ", message));
      }
    }
  }
  if (!outputs.ok()) {
    folder_lock_.reset();
    json_log_.reset();
    trace_.reset();
    if (ep_ != nullptr) (void)ep_->Close();
    return outputs;
  }
  prepared_ = true;
  return absl::OkStatus();
}

absl::Status Trainer::EndRun(StepLog* json, absl::Status failure) {
  SetPhase(TrainPhase::kIdle);
  if (json != nullptr) {
    if (absl::Status s = json->Close(); failure.ok()) failure = s;
  }
  // Load traces end with the run; a write error (disk full) is reported, not dropped.
  if (failure.ok() && ep_ != nullptr) failure = ep_->Close();
  if (failure.ok() && trace_.has_value()) {
    failure = trace_->Close();
  }
  trace_.reset();
  // The run is over: the checkpoint folder is free for the next writer.
  folder_lock_.reset();
  prepared_ = false;
  return failure;
}

absl::StatusOr<TrainSummary> Trainer::Run(const std::vector<TrainObserver*>& observers) {
  TrainSummary summary;
  summary.first_step = step_;
  summary.train_unigram_entropy = train_entropy_;
  if (!prepared_) {
    if (absl::Status s = Prepare(); !s.ok()) return s;
  }
  std::vector<TrainObserver*> all = observers;
  // The job's own JSON log (logging.json), written by rank 0 like the checkpoints.
  std::unique_ptr<TrainObserver> json_observer = std::move(json_log_);
  StepLog* json = static_cast<StepLog*>(json_observer.get());
  if (json != nullptr) all.push_back(json);
  const base::Stopwatch run_clock;
  double train_seconds = 0;
  const int64_t tokens_per_step =
      static_cast<int64_t>(config_.microbatches) * config_.batch_size * config_.seq_len;
  absl::Status failure;
  int64_t checkpointed = -1;  // step of the last checkpoint this run wrote
  const auto checkpoint = [&]() -> absl::Status {
    SetPhase(TrainPhase::kCheckpoint);
    absl::StatusOr<std::string> path = SaveCheckpoint();
    if (!path.ok()) return path.status();
    summary.last_checkpoint = *path;
    checkpointed = step_;
    for (TrainObserver* o : all) o->OnCheckpoint(step_, *path);
    return absl::OkStatus();
  };
  while (step_ < config_.steps) {
    absl::StatusOr<StopReason> stop = AgreeOnStop();
    if (!stop.ok()) {
      failure = stop.status();
      break;
    }
    if (*stop != StopReason::kNone) {
      summary.stopped = *stop;
      if (*stop == StopReason::kDrain && !config_.checkpoint_dir.empty() && checkpointed != step_ &&
          step_ > summary.first_step) {
        failure = checkpoint();
      }
      break;
    }
    const base::Stopwatch step_clock;
    absl::StatusOr<StepRecord> r = Step();
    if (!r.ok()) {
      failure = r.status();
      break;
    }
    const double seconds = step_clock.Seconds();
    train_seconds += seconds;
    summary.tokens += tokens_per_step;
    summary.losses.push_back(r->loss);
    r->step_s = seconds;
    r->tokens = tokens_per_step;
    r->total_steps = config_.steps;
    const bool last = step_ == config_.steps;
    const bool evaluate =
        validation_loader_ != nullptr &&
        (last || (config_.eval_interval > 0 && step_ % config_.eval_interval == 0));
    if (evaluate) {
      SetPhase(TrainPhase::kEvaluate);
      absl::StatusOr<double> val = EvaluateValidation();
      if (!val.ok()) {
        failure = val.status();
        break;
      }
      r->val_loss = *val;
      summary.final_val_loss = *val;
    }
    r->elapsed_s = run_clock.Seconds();
    for (TrainObserver* o : all) o->OnStep(*r);
    // A log that cannot be written stops the run (the checkpoints still resume it).
    if (json != nullptr && !json->status().ok()) {
      failure = json->status();
      break;
    }
    if (!config_.checkpoint_dir.empty() &&
        (last || (config_.checkpoint_interval > 0 && step_ % config_.checkpoint_interval == 0))) {
      if (failure = checkpoint(); !failure.ok()) break;
    }
  }
  failure = EndRun(json, std::move(failure));
  if (!failure.ok()) return failure;
  summary.steps = step_;
  summary.elapsed_s = run_clock.Seconds();
  summary.tokens_per_s =
      train_seconds > 0 ? static_cast<double>(summary.tokens) / train_seconds : 0;
  SummarizeLosses(summary);
  return summary;
}

}  // namespace rackrun::runtime
