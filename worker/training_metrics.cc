#include "worker/training_metrics.h"

#include <algorithm>
#include <functional>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "metrics/buckets.h"

namespace rackrun::worker {

namespace {

using metrics::BalancingSecondsBuckets;
using metrics::ImbalanceBuckets;
using metrics::StepSecondsBuckets;
using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

// One metric family, `name` with `help`, registered on r.
prometheus::Family<prometheus::Gauge>& GaugeFamily(prometheus::Registry& r, const char* name,
                                                   const char* help) {
  return BuildGauge().Name(name).Help(help).Register(r);
}
prometheus::Family<prometheus::Histogram>& HistogramFamily(prometheus::Registry& r,
                                                           const char* name, const char* help) {
  return BuildHistogram().Name(name).Help(help).Register(r);
}
prometheus::Family<prometheus::Counter>& CounterFamily(prometheus::Registry& r, const char* name,
                                                       const char* help) {
  return BuildCounter().Name(name).Help(help).Register(r);
}

}  // namespace

double ModelFlopsPerToken(const rackrun::v1::JobSpec& spec, int64_t parameters) {
  const auto& m = spec.model();
  const double hidden = m.moe().expert_hidden() > 0 ? m.moe().expert_hidden() : 2.0 * m.width();
  const double top_k = m.moe().top_k() > 0 ? m.moe().top_k() : 2;
  const double idle = std::max(0.0, m.moe().experts() - top_k);
  const double inactive = static_cast<double>(m.blocks()) * idle * 3.0 * m.width() * hidden;
  return 6.0 * std::max(0.0, static_cast<double>(parameters) - inactive);
}

struct TrainingMetrics::Families {
  explicit Families(prometheus::Registry& r)
      : step_seconds(
            HistogramFamily(r, "rackrun_train_step_duration_seconds",
                            "Wall-clock seconds of one optimizer step on this rank (without "
                            "evaluation and checkpoints)")),
        step(GaugeFamily(r, "rackrun_train_step",
                         "Optimizer steps done (resumed runs continue the count)")),
        total_steps(GaugeFamily(r, "rackrun_train_steps_target", "training.steps of the job")),
        tokens(
            CounterFamily(r, "rackrun_train_tokens_total",
                          "Training tokens this rank processed (its share of every global batch; "
                          "sum over ranks = the job's tokens)")),
        loss(GaugeFamily(r, "rackrun_train_loss",
                         "Training loss of the last step (mean over its microbatches)")),
        val_loss(GaugeFamily(r, "rackrun_train_validation_loss",
                             "Validation loss of the last evaluation")),
        grad_norm(GaugeFamily(r, "rackrun_train_grad_norm",
                              "Global gradient norm of the last step, before clipping")),
        lr(GaugeFamily(r, "rackrun_train_learning_rate", "Learning rate of the last step")),
        flops(GaugeFamily(r, "rackrun_train_model_flops_per_second",
                          "Model FLOP/s of this rank in the last step: 6 x active parameters x "
                          "tokens / seconds")),
        mfu(GaugeFamily(
            r, "rackrun_train_mfu_ratio",
            "Model FLOP/s utilisation of this rank: model FLOP/s / declared peak FLOP/s "
            "of one device (0-1)")),
        peak(GaugeFamily(r, "rackrun_device_peak_flops",
                         "Declared peak FLOP/s of one device (--peak-flops)")),
        phase(
            GaugeFamily(r, "rackrun_train_phase",
                        "1 for the phase this rank is in, 0 for the other phases it has been in")),
        imbalance_before(
            GaugeFamily(r, "rackrun_moe_last_imbalance_before",
                        "Max / mean tokens per rank of an MoE layer with masters only, "
                        "mean over the last step's microbatches (1 = balanced)")),
        imbalance_after(
            GaugeFamily(r, "rackrun_moe_last_imbalance_after",
                        "Max / mean tokens per rank of an MoE layer under the executed "
                        "plans, mean over the last step's microbatches (1 = balanced)")),
        imbalance_before_h(HistogramFamily(
            r, "rackrun_moe_imbalance_before",
            "Per step: max / mean tokens per rank of an MoE layer with masters only")),
        imbalance_after_h(HistogramFamily(
            r, "rackrun_moe_imbalance_after",
            "Per step: max / mean tokens per rank of an MoE layer under the executed plans")),
        replicas(GaugeFamily(
            r, "rackrun_moe_replicas",
            "Replica instances of an MoE layer, mean over the last step's microbatches")),
        plan_seconds(
            HistogramFamily(r, "rackrun_moe_plan_seconds",
                            "Per step: seconds this rank spent planning (load exchange, solve, "
                            "invariant and agreement checks)")),
        plan_exchange_seconds(
            HistogramFamily(r, "rackrun_moe_plan_exchange_seconds",
                            "Per step: of rackrun_moe_plan_seconds, seconds in the load exchange "
                            "(in-band: the allgather; coordinator mode: the round trips and the "
                            "fingerprint allgather), waiting for the other ranks included")),
        round_trip(HistogramFamily(
            r, "rackrun_moe_plan_round_trip_seconds",
            "Coordinator mode: seconds from sending a load row to receiving its plan")),
        fanout_seconds(
            HistogramFamily(r, "rackrun_moe_fanout_seconds",
                            "Per step: seconds this rank spent fanning replica weights out")),
        dispatch_seconds(HistogramFamily(r, "rackrun_moe_dispatch_seconds",
                                         "Per step: seconds this rank spent in token all-to-alls "
                                         "(dispatch and combine, forward and backward)")),
        reduce_seconds(HistogramFamily(
            r, "rackrun_moe_reduce_seconds",
            "Per step: seconds this rank spent reducing replica gradients into masters")),
        balancing_seconds(CounterFamily(
            r, "rackrun_moe_balancing_seconds_total",
            "Seconds this rank spent planning, fanning out and reducing replica gradients")),
        step_seconds_total(CounterFamily(r, "rackrun_train_step_seconds_total",
                                         "Seconds this rank spent in optimizer steps")),
        fanout_bytes(CounterFamily(r, "rackrun_moe_fanout_bytes_total",
                                   "Replica-weight bytes this rank sent (relay fan-out)")),
        reduce_bytes(CounterFamily(r, "rackrun_moe_reduce_bytes_total",
                                   "Replica-gradient bytes this rank sent to masters")),
        dispatch_bytes(CounterFamily(
            r, "rackrun_moe_dispatch_bytes_total",
            "Token bytes through this rank's instances in the all-to-alls: 4 x rows x "
            "width x 4 bytes (dispatch and combine, forward and backward)")),
        gpu_in_use(GaugeFamily(r, "rackrun_gpu_memory_in_use_bytes",
                               "GPU jobs: device bytes in live blocks of the engine's caching "
                               "allocator after the last step (size-class bytes)")),
        gpu_peak(GaugeFamily(r, "rackrun_gpu_memory_peak_bytes",
                             "GPU jobs: the peak of rackrun_gpu_memory_in_use_bytes since the "
                             "attempt's engine started")),
        gpu_reserved(GaugeFamily(r, "rackrun_gpu_memory_reserved_bytes",
                                 "GPU jobs: device bytes the caching allocator holds from "
                                 "cudaMalloc (in use + cached for reuse)")),
        gpu_total(GaugeFamily(r, "rackrun_gpu_memory_total_bytes",
                              "GPU jobs: device memory of the job's GPU")),
        gpu_step(GaugeFamily(r, "rackrun_gpu_step_device_seconds",
                             "GPU jobs: device seconds of the last step by phase (gemm, attention, "
                             "streams, routing, optimizer, other; CUDA events on the compute "
                             "stream)")) {}

  prometheus::Family<prometheus::Histogram>& step_seconds;
  prometheus::Family<prometheus::Gauge>& step;
  prometheus::Family<prometheus::Gauge>& total_steps;
  prometheus::Family<prometheus::Counter>& tokens;
  prometheus::Family<prometheus::Gauge>& loss;
  prometheus::Family<prometheus::Gauge>& val_loss;
  prometheus::Family<prometheus::Gauge>& grad_norm;
  prometheus::Family<prometheus::Gauge>& lr;
  prometheus::Family<prometheus::Gauge>& flops;
  prometheus::Family<prometheus::Gauge>& mfu;
  prometheus::Family<prometheus::Gauge>& peak;
  prometheus::Family<prometheus::Gauge>& phase;
  prometheus::Family<prometheus::Gauge>& imbalance_before;
  prometheus::Family<prometheus::Gauge>& imbalance_after;
  prometheus::Family<prometheus::Histogram>& imbalance_before_h;
  prometheus::Family<prometheus::Histogram>& imbalance_after_h;
  prometheus::Family<prometheus::Gauge>& replicas;
  prometheus::Family<prometheus::Histogram>& plan_seconds;
  prometheus::Family<prometheus::Histogram>& plan_exchange_seconds;
  prometheus::Family<prometheus::Histogram>& round_trip;
  prometheus::Family<prometheus::Histogram>& fanout_seconds;
  prometheus::Family<prometheus::Histogram>& dispatch_seconds;
  prometheus::Family<prometheus::Histogram>& reduce_seconds;
  prometheus::Family<prometheus::Counter>& balancing_seconds;
  prometheus::Family<prometheus::Counter>& step_seconds_total;
  prometheus::Family<prometheus::Counter>& fanout_bytes;
  prometheus::Family<prometheus::Counter>& reduce_bytes;
  prometheus::Family<prometheus::Counter>& dispatch_bytes;
  prometheus::Family<prometheus::Gauge>& gpu_in_use;
  prometheus::Family<prometheus::Gauge>& gpu_peak;
  prometheus::Family<prometheus::Gauge>& gpu_reserved;
  prometheus::Family<prometheus::Gauge>& gpu_total;
  prometheus::Family<prometheus::Gauge>& gpu_step;

  // Every series this object added, removed by the destructor.
  std::mutex mu;  // removers: series are added from the training and heartbeat threads
  std::vector<std::function<void()>> removers;

  template <typename T>
  T& Add(prometheus::Family<T>& family, const prometheus::Labels& labels) {
    T& m = family.Add(labels);
    std::lock_guard<std::mutex> lock(mu);
    removers.push_back([&family, &m] { family.Remove(&m); });
    return m;
  }
  prometheus::Histogram& Add(prometheus::Family<prometheus::Histogram>& family,
                             const prometheus::Labels& labels, const std::vector<double>& buckets) {
    prometheus::Histogram& m = family.Add(labels, buckets);
    std::lock_guard<std::mutex> lock(mu);
    removers.push_back([&family, &m] { family.Remove(&m); });
    return m;
  }

  // The rank's series, made in the constructor.
  prometheus::Histogram* h_step = nullptr;
  prometheus::Gauge *g_step = nullptr, *g_total = nullptr, *g_loss = nullptr, *g_grad = nullptr,
                    *g_lr = nullptr;
  prometheus::Gauge *g_val = nullptr, *g_flops = nullptr, *g_mfu = nullptr;
  prometheus::Counter *c_tokens = nullptr, *c_balancing = nullptr, *c_step = nullptr;
  prometheus::Counter *c_fanout = nullptr, *c_reduce = nullptr, *c_dispatch = nullptr;
  prometheus::Histogram *h_plan = nullptr, *h_exchange = nullptr, *h_rt = nullptr,
                        *h_fanout = nullptr, *h_dispatch = nullptr, *h_reduce = nullptr;
  struct Layer {
    prometheus::Gauge *before = nullptr, *after = nullptr, *replicas = nullptr;
    prometheus::Histogram *before_h = nullptr, *after_h = nullptr;
  };
  std::vector<Layer> layers;
  // GPU jobs: made with the first OnDeviceStep.
  prometheus::Gauge *g_gpu_in_use = nullptr, *g_gpu_peak = nullptr, *g_gpu_reserved = nullptr,
                    *g_gpu_total = nullptr;
  std::vector<prometheus::Gauge*> g_gpu_phase;  // by runtime::DeviceStepStats::phase_names
};

TrainingMetrics::TrainingMetrics(prometheus::Registry& registry, Options options)
    : options_(std::move(options)), f_(std::make_unique<Families>(registry)) {
  Families& f = *f_;
  const prometheus::Labels l = Labels();
  f.h_step = &f.Add(f.step_seconds, l, StepSecondsBuckets());
  f.g_step = &f.Add(f.step, l);
  f.g_total = &f.Add(f.total_steps, l);
  f.g_total->Set(static_cast<double>(options_.total_steps));
  f.c_tokens = &f.Add(f.tokens, l);
  f.g_loss = &f.Add(f.loss, l);
  f.g_grad = &f.Add(f.grad_norm, l);
  f.g_lr = &f.Add(f.lr, l);
  f.c_step = &f.Add(f.step_seconds_total, l);
  if (options_.flops_per_token > 0) f.g_flops = &f.Add(f.flops, l);
  if (options_.flops_per_token > 0 && options_.peak_flops > 0) {
    f.g_mfu = &f.Add(f.mfu, l);
    f.Add(f.peak, l).Set(options_.peak_flops);
  }
  if (options_.ranks > 1) {
    const prometheus::Labels dl = DomainLabels();
    f.h_plan = &f.Add(f.plan_seconds, dl, BalancingSecondsBuckets());
    f.h_exchange = &f.Add(f.plan_exchange_seconds, dl, BalancingSecondsBuckets());
    f.h_fanout = &f.Add(f.fanout_seconds, dl, BalancingSecondsBuckets());
    f.h_dispatch = &f.Add(f.dispatch_seconds, dl, BalancingSecondsBuckets());
    f.h_reduce = &f.Add(f.reduce_seconds, dl, BalancingSecondsBuckets());
    f.c_balancing = &f.Add(f.balancing_seconds, dl);
    if (options_.group != nullptr) {
      f.c_fanout = &f.Add(f.fanout_bytes, dl);
      f.c_reduce = &f.Add(f.reduce_bytes, dl);
      f.c_dispatch = &f.Add(f.dispatch_bytes, dl);
    }
  }
}

TrainingMetrics::~TrainingMetrics() {
  for (auto it = f_->removers.rbegin(); it != f_->removers.rend(); ++it) (*it)();
}

prometheus::Labels TrainingMetrics::Labels() const {
  return {{"job_id", options_.job_id}, {"rank", absl::StrCat(options_.rank)}};
}

int TrainingMetrics::Domain() const {
  const int g =
      options_.expert_parallel > 0 ? options_.expert_parallel : std::max(1, options_.ranks);
  return options_.rank / g;
}

prometheus::Labels TrainingMetrics::DomainLabels() const {
  prometheus::Labels l = Labels();
  l["domain"] = absl::StrCat(Domain());
  return l;
}

prometheus::Labels TrainingMetrics::LayerLabels(size_t layer) const {
  return {{"job_id", options_.job_id},
          {"domain", absl::StrCat(Domain())},
          {"layer", absl::StrCat(layer)}};
}

void TrainingMetrics::OnStep(const runtime::StepRecord& r) {
  Families& f = *f_;
  f.h_step->Observe(r.step_s);
  f.c_step->Increment(std::max(0.0, r.step_s));
  f.g_step->Set(static_cast<double>(r.step));
  if (r.total_steps > 0) f.g_total->Set(static_cast<double>(r.total_steps));
  const double my_tokens = static_cast<double>(r.tokens) / std::max(1, options_.ranks);
  f.c_tokens->Increment(std::max(0.0, my_tokens));
  f.g_loss->Set(r.loss);
  f.g_grad->Set(r.grad_norm);
  f.g_lr->Set(r.lr);
  if (r.val_loss.has_value()) {
    if (f.g_val == nullptr) f.g_val = &f.Add(f.val_loss, Labels());
    f.g_val->Set(*r.val_loss);
  }
  if (f.g_flops != nullptr && r.step_s > 0) {
    const double flops = options_.flops_per_token * my_tokens / r.step_s;
    f.g_flops->Set(flops);
    if (f.g_mfu != nullptr) f.g_mfu->Set(flops / options_.peak_flops);
  }
  if (options_.device != nullptr) {
    // A failure to read the figures costs the series one step, never the step.
    absl::StatusOr<runtime::DeviceStepStats> device = options_.device->StepStats();
    if (device.ok()) OnDeviceStep(*device);
  }
  if (options_.ranks <= 1) return;
  f.h_plan->Observe(r.plan_s);
  f.h_exchange->Observe(r.plan_exchange_s);
  f.h_fanout->Observe(r.fanout_s);
  f.h_dispatch->Observe(r.dispatch_s);
  f.h_reduce->Observe(r.reduce_s);
  f.c_balancing->Increment(std::max(0.0, r.plan_s + r.fanout_s + r.reduce_s));
  const runtime::ExpertParallelStats* st =
      options_.group != nullptr ? &options_.group->stats() : nullptr;
  if (st != nullptr) {
    f.c_fanout->Increment(static_cast<double>(std::max<int64_t>(0, st->fanout_bytes)));
    f.c_reduce->Increment(static_cast<double>(std::max<int64_t>(0, st->reduce_bytes)));
    f.c_dispatch->Increment(4.0 * static_cast<double>(std::max<int64_t>(0, st->expert_rows)) *
                            options_.width * sizeof(float));
  }
  // Per-layer series are the same on every rank of a domain: its first rank exports them.
  const int g = options_.expert_parallel > 0 ? options_.expert_parallel : options_.ranks;
  if (options_.rank % std::max(1, g) != 0) return;
  const size_t n = std::min(r.rank_imbalance_before.size(), r.rank_imbalance_after.size());
  while (f.layers.size() < n) {
    const prometheus::Labels ll = LayerLabels(f.layers.size());
    Families::Layer layer;
    layer.before = &f.Add(f.imbalance_before, ll);
    layer.after = &f.Add(f.imbalance_after, ll);
    layer.before_h = &f.Add(f.imbalance_before_h, ll, ImbalanceBuckets());
    layer.after_h = &f.Add(f.imbalance_after_h, ll, ImbalanceBuckets());
    layer.replicas = &f.Add(f.replicas, ll);
    f.layers.push_back(layer);
  }
  for (size_t i = 0; i < n; ++i) {
    Families::Layer& layer = f.layers[i];
    layer.before->Set(r.rank_imbalance_before[i]);
    layer.after->Set(r.rank_imbalance_after[i]);
    layer.before_h->Observe(r.rank_imbalance_before[i]);
    layer.after_h->Observe(r.rank_imbalance_after[i]);
    double replicas = r.replicas;
    if (st != nullptr && i < st->layers.size()) {
      const auto& sl = st->layers[i];
      replicas = static_cast<double>(sl.replicas) /
                 static_cast<double>(std::max<int64_t>(1, sl.microbatches));
    }
    layer.replicas->Set(replicas);
  }
}

void TrainingMetrics::OnDeviceStep(const runtime::DeviceStepStats& stats) {
  Families& f = *f_;
  if (f.g_gpu_in_use == nullptr) {
    const prometheus::Labels l = Labels();
    f.g_gpu_in_use = &f.Add(f.gpu_in_use, l);
    f.g_gpu_peak = &f.Add(f.gpu_peak, l);
    f.g_gpu_reserved = &f.Add(f.gpu_reserved, l);
    f.g_gpu_total = &f.Add(f.gpu_total, l);
    for (const char* phase : runtime::DeviceStepStats::phase_names) {
      prometheus::Labels pl = l;
      pl["phase"] = phase;
      f.g_gpu_phase.push_back(&f.Add(f.gpu_step, pl));
    }
  }
  f.g_gpu_in_use->Set(static_cast<double>(stats.memory_in_use_bytes));
  f.g_gpu_peak->Set(static_cast<double>(stats.memory_peak_bytes));
  f.g_gpu_reserved->Set(static_cast<double>(stats.memory_reserved_bytes));
  f.g_gpu_total->Set(static_cast<double>(stats.memory_total_bytes));
  for (size_t p = 0; p < f.g_gpu_phase.size(); ++p) f.g_gpu_phase[p]->Set(stats.phase_ms[p] / 1e3);
}

void TrainingMetrics::SetPhase(std::string_view phase) {
  std::lock_guard<std::mutex> lock(phase_mu_);
  auto it = phases_.find(phase);
  if (it == phases_.end()) {
    prometheus::Labels l = Labels();
    l["phase"] = std::string(phase);
    it = phases_.emplace(std::string(phase), &f_->Add(f_->phase, l)).first;
  }
  for (auto& [name, gauge] : phases_) gauge->Set(name == phase ? 1 : 0);
}

void TrainingMetrics::ObservePlanRoundTrip(double seconds) {
  std::lock_guard<std::mutex> lock(phase_mu_);
  if (f_->h_rt == nullptr)
    f_->h_rt = &f_->Add(f_->round_trip, DomainLabels(), BalancingSecondsBuckets());
  f_->h_rt->Observe(seconds);
}

}  // namespace rackrun::worker
