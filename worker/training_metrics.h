// TrainingMetrics: the worker's Prometheus series of one job on one rank, as a
// runtime::TrainObserver the worker attaches to its Trainer on every rank (docs/design.md
// section 9; the series are listed in metrics/expected_series.h). The registry and its
// exporter are the metrics module's (metrics/exporter.h). Per step it records the training figures
// (step time, tokens, loss, validation loss, gradient norm, learning rate, model FLOP/s and MFU)
// and the balancing figures (imbalance before/after and replicas per MoE layer, seconds spent
// planning, fanning out, in token all-to-alls and reducing replica gradients, bytes moved).
//
// Labels: job_id and rank (not `job`: Prometheus owns the `job` label of every scraped
// target and would rename ours to exported_job); layer for per-layer series; domain (the
// expert-parallel domain, rank / G with G = parallelism.expert_parallel) on every
// balancing series (rackrun_moe_*). Per-layer series are the same on every rank of a
// domain (its load matrix is allgathered inside it), so only the domain's first rank
// exports them, labelled job_id, domain, layer: series count = layers x domains, not
// layers x ranks (one domain: rank 0 only, domain="0"). Expert ids never become labels.
//
// Model FLOPs: 6 x active parameters per token (forward 2, backward 4 multiply-adds per
// parameter and token; Kaplan et al. 2020), attention's sequence-length term left out.
// Active parameters = all parameters minus the routed experts a token does not visit
// (blocks x (experts - top_k) x 3 x width x expert_hidden). MFU = this rank's model FLOP/s
// / the declared peak FLOP/s of one device (`--peak-flops`); without a peak, no MFU series.
//
// GPU jobs (resources.device: cuda) add the rackrun_gpu_* series: device memory from the
// engine's caching allocator (in use, peak, reserved, the device's total) and the last
// step's device seconds per phase (CUDA events, runtime/cuda/phase_clock.h). Not run on a GPU.
//
// Series stay after the job ends (its last values remain visible) until this object is
// destroyed; destroy it before starting the next job's (the series are removed then).
//
// Thread safety: OnStep runs on the training thread; SetPhase and ObservePlanRoundTrip may
// be called from any thread (the worker's heartbeat thread, its plan source).
#ifndef RACKRUN_WORKER_TRAINING_METRICS_H_
#define RACKRUN_WORKER_TRAINING_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "rackrun/v1/job_spec.pb.h"
#include "runtime/trainer.h"

namespace rackrun::worker {

// 6 x active parameters per token of a defaulted spec whose model has `parameters`
// parameters in all (Trainer::parameter_count()). See the header comment.
double ModelFlopsPerToken(const rackrun::v1::JobSpec& spec, int64_t parameters);

class TrainingMetrics final : public runtime::TrainObserver {
 public:
  struct Options {
    std::string job_id;
    int rank = 0;
    int ranks = 1;
    // Ranks per expert-parallel domain (Trainer::expert_parallel_degree()); 0 = ranks (one
    // domain). Must divide ranks.
    int expert_parallel = 0;
    double flops_per_token = 0;  // ModelFlopsPerToken; 0 = no FLOP/s and MFU series
    double peak_flops = 0;       // per device; 0 = no MFU series
    int64_t total_steps = 0;     // training.steps
    int width = 0;               // model.width, for dispatch bytes
    // Per-layer replicas and byte counts come from here (Trainer::expert_parallel(); null
    // in a single-process job). Read in OnStep only, on the training thread.
    const runtime::ExpertParallelGroup* group = nullptr;
    // The job's GPU engine (Trainer::device_engine(); null for resources.device: cpu): its
    // StepStats after every step feed the rackrun_gpu_* series (OnDeviceStep).
    runtime::DeviceEngine* device = nullptr;
  };

  TrainingMetrics(prometheus::Registry& registry, Options options);
  ~TrainingMetrics() override;

  void OnStep(const runtime::StepRecord& record) override;
  // The GPU series from one step's device figures (OnStep calls it with the engine's
  // StepStats; the series appear with the first call): memory in use, peak and reserved by
  // the engine's caching allocator, the device's memory, and the step's device seconds per
  // phase.
  void OnDeviceStep(const runtime::DeviceStepStats& stats);

  // The rank's phase while it trains (runtime::TrainPhaseName, or "collective" while the
  // worker sees it blocked in one): rackrun_train_phase{phase} is 1 for it and 0 for the
  // others seen.
  void SetPhase(std::string_view phase);
  // Coordinator-mode planning: seconds from sending a load row to receiving its plan.
  void ObservePlanRoundTrip(double seconds);

  const Options& options() const { return options_; }

 private:
  struct Families;
  int Domain() const;
  prometheus::Labels Labels() const;
  prometheus::Labels DomainLabels() const;  // Labels() and domain: balancing series
  prometheus::Labels LayerLabels(size_t layer) const;

  Options options_;
  std::unique_ptr<Families> f_;
  std::mutex phase_mu_;
  std::map<std::string, prometheus::Gauge*, std::less<>> phases_;  // guarded by phase_mu_
};

}  // namespace rackrun::worker

#endif  // RACKRUN_WORKER_TRAINING_METRICS_H_
