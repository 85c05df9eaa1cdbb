// Expert parallelism with per-microbatch UltraEP rebalancing (docs/design.md section 4).
//
// R ranks each hold E/R master experts of every MoE layer (the model is built with
// ModelConfig::expert_rank/expert_ranks) plus replica slots. For every microbatch and
// every MoE layer, each rank's executor:
//   1. allgathers the exact per-expert loads of its tokens (an R x E load matrix);
//   2. solves the plan with the job's policy (every rank solves the same plan in-band) and
//      checks it with the planner's invariant checker. Ranks compare plan fingerprints: in
//      band, each rank's fingerprint of its previous plan rides in the next load allgather
//      (no collective of its own), so a disagreement is found one plan later (the next
//      layer, or the next microbatch's first layer) and stops the job naming the ranks and
//      the disagreeing plan's layer and microbatch; the job's last plan is not compared. A
//      source that exchanges nothing among the ranks (the coordinator) gets a fingerprint
//      allgather of its own after every solve;
//   3. posts the fan-out of replica weights from the masters' ranks along the plan's relay
//      schedule (FanoutScheduler, built once by the planner), unless the slots already hold
//      the same experts at the same weight version (EPLB keeps a placement for many
//      microbatches; weights change only at optimizer steps);
//   4. dispatches every routed token to the instance the plan's per-source split names
//      (one all-to-all-v) and runs the instances whose weights are local (masters) while
//      the replica weights travel, completes the fan-out, runs the replicas from the slots
//      and combines the results back in the original order.
// Backward mirrors it; each replica's weight gradient is then sent to the expert's home
// rank without waiting (it travels while lower layers run their backward), and
// FinishMicrobatch adds them to the masters' gradients in a fixed order (the master's own
// contribution first, then replicas by ascending rank): deterministic, no atomics. Which
// batch runs when changes no value: every batch writes its own rows and gradients.
//
// Steps 1-3 need the counts only: a caller whose rows are still on their way (the GPU layer
// copying them to the host) runs them first, through ExpertExecutor::PrepareForward, so that
// they overlap that copy; PrepareBackward likewise finishes the layers sharing the gradient
// buffer and posts the backward refetch. A pass that was not prepared prepares itself.
//
// The executor decides and moves bytes (host buffers, the job's channel); where this rank's
// masters and replica slots live and run is behind ExpertInstances (expert_instances.h): on
// the host for MoeLayer<float> layers, on a GPU, host-staged, for the GPU engine's layers
// (the general Create below). When the channel takes device buffers
// (DataChannel::takes_device_buffers: NCCL) and the instances offer device rows, the bytes stay
// on that GPU: the executor dispatches and combines the rows there (ExpertInstances::
// device_rows; its Forward and Backward then take device buffers, ExpertExecutor::device_rows),
// fans replica weights out from and into the instances' device memory and sends replica
// gradients from and receives them into it (ExpertInstances' device weights and gradients).
//
// Weights live at the home rank (rank e / (E/R) for expert e); an instance the plan puts
// anywhere else receives them by fan-out. For ultraep and none that is exactly the plan's
// replicas; EPLB may also move a master, which is executed the same way (its weights and
// gradient stay at home; the bytes EPLB would move are reported by the planner).
//
// Replica slot memory (ExpertParallelOptions::share_slots):
// - shared (UltraEP's design, the trainer's choice for ultraep): one set of slots per rank
//   for all MoE layers. Each layer's forward fills them; a layer's backward needs its
//   replicas' weights again when a later layer has taken the slots since (every layer but
//   the last one forward ran). The layer above posts that refetch as soon as its own
//   backward expert compute is done with the slots, so it travels during that layer's
//   combine and the blocks between; memory stays at `slots` experts per rank (plus a
//   second gradient buffer) at the cost of a second fan-out, mostly hidden.
// - per layer (the trainer's choice for eplb, whose redundant experts are resident per
//   layer in DeepSeek's deployment): backward finds the weights forward used, and a
//   placement that does not change between optimizer steps is not sent again.
//
// Plans come from a PlanSource (plan_source.h): in-band by default, or the coordinator.
//
// With D expert-parallel domains (parallelism.expert_parallel) the group's channel is one
// domain of G ranks: everything above happens inside it (loads, plans, replicas, fan-out,
// dispatch, replica gradients never leave the domain); only the per-expert token totals
// are summed across domains (ExpertParallelOptions::replicas). Reducing expert gradients
// across domains is the trainer's.
//
// Fault injection for tests: the process's fault when the group is created
// (ProcessFaultInjection, fault_injection.h): plan_hash perturbs a rank's plan
// fingerprint, stall makes it sleep past the channel timeout before the load exchange,
// exit ends its process there.
#ifndef RACKRUN_RUNTIME_EXPERT_PARALLEL_H_
#define RACKRUN_RUNTIME_EXPERT_PARALLEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/data_channel.h"
#include "planner/invariants.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "planner/trace.h"
#include "runtime/expert_instances.h"
#include "runtime/fault_injection.h"
#include "runtime/model.h"
#include "runtime/plan_source.h"

namespace rackrun::runtime {

struct ExpertParallelOptions {
  std::string policy = "none";  // none | ultraep | eplb
  int slots = 2;                // replica slots per rank and layer
  // eps, minimum replica tokens, locality, EPLB window/interval and the fan-out rule.
  // expert_bytes 0 is filled in from the model.
  planner::PlannerOptions planner;
  // Run the planner's invariant checker on every plan before executing it.
  bool check_invariants = true;
  // Replica slots shared by all MoE layers (true) or kept per layer (see above).
  bool share_slots = true;
  int64_t chunk_bytes = 256 << 10;  // fan-out chunk
  // Rank 0 appends every training microbatch's load matrix here (planner trace format);
  // empty = off.
  std::string load_trace;
  // Expert-parallel domains (parallelism.expert_parallel): the group's channel is one
  // domain; this channel joins the ranks that hold the same shard in every domain (this
  // rank's index in its domain). The per-expert token totals the MoE layers use (auxiliary
  // loss, selection-bias update) are summed over it, so they count the global microbatch
  // as with one domain. Null or one rank = one domain. Not owned; must outlive the group.
  comm::DataChannel* replicas = nullptr;
  // Where plans come from; null = in-band (the group makes an InBandPlanSource with
  // `policy` and `planner`). Not owned; must outlive the group.
  PlanSource* plan_source = nullptr;
};

// Sums since the last ResetStats (the trainer resets once per optimizer step). Times
// are this rank's wall-clock seconds.
struct ExpertParallelStats {
  struct Layer {
    int64_t microbatches = 0;
    double imbalance_before = 0;  // sum of max/mean rank load with masters only
    double imbalance_after = 0;   // sum of max/mean rank load under the executed plan
    int64_t replicas = 0;         // sum of replica instances
  };
  std::vector<Layer> layers;
  double plan_s = 0;                   // load allgather + solve + invariant check (+ fingerprint
                                       // allgather for sources that do not carry it)
  double plan_exchange_s = 0;          // of plan_s: its exchanges, waiting for the other ranks
                                       // included: the plan source's (last_exchange_seconds), the
                                       // fingerprint allgather where the source needs one, and
                                       // with D > 1 domains plan_domains_exchange_s
  double plan_domains_exchange_s = 0;  // of plan_exchange_s: the all-reduce of the expert
                                       // totals over the domains (`replicas`; 0 with one
                                       // domain), waiting for the other domains included
  double fanout_s = 0;                 // replica weights to their ranks: time spent posting and
                                       // completing the fan-outs (the exposed part)
  double dispatch_s = 0;        // token all-to-alls (dispatch and combine, forward and backward);
                                // with device rows also the wait for the GPU work queued before
                                // each packing (the routing, the shared expert)
  double expert_s = 0;          // local expert compute, masters and replicas (with device rows:
                                // issuing the masters' GEMMs, then waiting for all of them at
                                // the replicas' pass, after the fan-out's exposed part)
  double reduce_s = 0;          // replica gradients into the masters (posting + completing)
  int64_t fanout_bytes = 0;     // weight bytes this rank sent
  int64_t fanouts = 0;          // fan-outs run (forward, and backward refetches)
  int64_t refetches = 0;        // of which in backward (shared slots taken by a later layer)
  int64_t fanouts_skipped = 0;  // fan-outs not needed: slots already current
  int64_t reduce_bytes = 0;     // replica gradient bytes this rank sent
  int64_t expert_rows = 0;      // token rows this rank's instances processed (forward)
  // Per rank of the domain (index = rank in the domain; the same on every rank of it):
  // tokens its instances get with masters only / under the executed plans, summed over
  // the layers and microbatches.
  std::vector<int64_t> rank_tokens_before;
  std::vector<int64_t> rank_tokens_after;
};

// Replica weights and gradients in slots, [slots x (w13 | w2)], and what the weights hold:
// the layer whose placement was fanned out into them, that placement, the weight version.
// Shared slots keep two gradient buffers, by layer parity, so that a layer's backward
// waits only for the replica-gradient sends of the layer two above it.
struct ReplicaSlotStore {
  std::vector<float> weights;
  std::vector<float> grads[2];
  int layer = -1;
  std::vector<planner::ExpertInstance> instances;
  std::vector<int32_t> first;
  int64_t version = -1;
};

class ExpertParallelExecutor;

// The expert-parallel group of one model replica on one rank: owns the planners, the
// statistics and the trace, and installs an ExpertParallelExecutor in every MoE layer of
// `model`. The channel and the model must outlive the group; the model's executors must
// not run after the group is destroyed.
class ExpertParallelGroup {
 public:
  // InvalidArgument naming the field when the model's shard does not match the channel
  // (expert_rank/expert_ranks vs rank/size) or the policy is unknown; an error if the load
  // trace cannot be opened.
  static absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> Create(
      comm::DataChannel& channel, Model<float>& model, const ExpertParallelOptions& options);
  // The same for bare MoE layers (layer i of `layers` is MoE layer i); every layer must
  // hold the shard of rank channel.rank() of channel.size().
  static absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> Create(
      comm::DataChannel& channel, const std::vector<MoeLayer<float>*>& layers,
      const ExpertParallelOptions& options);
  // The general form, for layers whose experts live elsewhere (the GPU engine's): per MoE
  // layer its configuration, the instances holding its shard (owned by the executor made for
  // it from then on) and where that executor goes (`install`, called once, during Create).
  struct Layer {
    MoeLayerConfig config;
    std::unique_ptr<ExpertInstances> instances;
    std::function<void(std::unique_ptr<ExpertExecutor<float>>)> install;
  };
  static absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> Create(
      comm::DataChannel& channel, std::vector<Layer> layers, const ExpertParallelOptions& options);
  ~ExpertParallelGroup();

  // Names the microbatch in errors and traces. Training microbatches use the training
  // planner (EPLB's history); evaluation ones a separate planner of the same policy.
  void BeginMicrobatch(int64_t microbatch, bool training) {
    microbatch_ = microbatch;
    training_ = training;
  }
  // Completes every layer's replica-gradient reduction of the microbatch (call after its
  // backward, before reading expert gradients or stepping the optimizer; a layer's next
  // Forward also completes its own). Collective in effect: peers wait for these sends.
  absl::Status FinishMicrobatch();
  // The same for the layers whose index has parity `parity` (they share a gradient buffer).
  absl::Status FinishLayers(int parity);
  // After every optimizer step (issued): replica weights held in slots are stale, and every
  // layer's instances are told (ExpertInstances::WeightsChanged).
  absl::Status WeightsChanged();

  // The planners' state between microbatches (EPLB's history and placement, of training
  // and of evaluation microbatches: PlanSource::SaveState; empty for ultraep and none),
  // identical on every rank of a domain, for checkpoints; with the coordinator as plan
  // source it is fetched from the coordinator (errors: PlanSource's).
  // RestoreState errors as Planner::RestoreState (FailedPrecondition: saved for another
  // rank count or other balancer settings, or a source that keeps none).
  absl::StatusOr<std::string> SaveState() { return plan_source_->SaveState(); }
  absl::Status RestoreState(std::string_view state) { return plan_source_->RestoreState(state); }

  const ExpertParallelStats& stats() const { return stats_; }
  void ResetStats();
  // Flushes and closes the load trace (also done by the destructor, errors dropped).
  absl::Status Close();
  // Records the load trace into `writer` from now on (instead of options.load_trace, which
  // is opened by Create and truncated; the trainer opens its own to extend a resumed one).
  void AttachTrace(planner::TraceWriter writer) { trace_.emplace(std::move(writer)); }

  const planner::Domain& domain() const { return domain_; }
  comm::DataChannel& channel() { return channel_; }

  // What the group's executors (one per MoE layer) work through.
  const ExpertParallelOptions& options() const { return options_; }
  const planner::InvariantOptions& invariants() const { return invariants_; }
  int64_t microbatch() const { return microbatch_; }
  bool training() const { return training_; }
  int64_t weights_version() const { return weights_version_; }
  ExpertParallelStats& mutable_stats() { return stats_; }
  // The one set of slots all layers share (options().share_slots).
  ReplicaSlotStore& shared_slots() { return shared_slots_; }
  PlanSource& plan_source() { return *plan_source_; }
  // Null when no load trace is written (off, or not rank 0).
  planner::TraceWriter* trace() { return trace_.has_value() ? &*trace_ : nullptr; }
  // True when the injected fault `kind` is due on this rank at `layer` now.
  bool FaultAt(FaultKind kind, int layer) const;

  // The plan this rank solved last (its fingerprint as sent for comparison), for sources
  // that compare fingerprints one plan later (PlanSource::carries_fingerprints).
  struct SolvedPlan {
    uint64_t fingerprint = 0;
    int layer = -1;
    int64_t microbatch = 0;
    bool training = true;
  };
  const std::optional<SolvedPlan>& previous_plan() const { return previous_plan_; }
  void RecordPlan(uint64_t fingerprint, int layer) {
    previous_plan_ = SolvedPlan{fingerprint, layer, microbatch_, training_};
  }
  // Shared slots: posts MoE layer `layer`'s backward refetch (nothing for layer -1, when
  // one is already in flight, or when that layer's slots are current); FinishRefetch
  // completes it (every Forward, Backward and FinishMicrobatch does first).
  absl::Status StartRefetch(int layer);
  absl::Status FinishRefetch();
  void RefetchDone(const ExpertParallelExecutor* e) {
    if (refetching_ == e) refetching_ = nullptr;
  }

 private:
  ExpertParallelGroup(comm::DataChannel& channel, const ExpertParallelOptions& options)
      : channel_(channel), options_(options), faults_(ProcessFaultInjection()) {}

  comm::DataChannel& channel_;
  ExpertParallelOptions options_;
  const std::optional<FaultInjection> faults_;  // the process's, when the group was created
  planner::Domain domain_;
  planner::InvariantOptions invariants_;
  std::unique_ptr<PlanSource> own_plan_source_;  // when options_.plan_source is null
  PlanSource* plan_source_ = nullptr;
  std::optional<planner::TraceWriter> trace_;
  std::vector<ExpertParallelExecutor*> executors_;  // owned by the MoE layers
  ReplicaSlotStore shared_slots_;                   // when options_.share_slots
  ExpertParallelStats stats_;
  int64_t microbatch_ = 0;
  bool training_ = true;
  int64_t weights_version_ = 0;
  std::optional<SolvedPlan> previous_plan_;
  ExpertParallelExecutor* refetching_ = nullptr;  // its backward refetch is in flight
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_EXPERT_PARALLEL_H_
