// The training loop: JobSpec -> model, data, AdamW, checkpoints, logs; in one process, or
// expert-parallel over the ranks of a data channel.
//
// One optimizer step = `training.microbatches` microbatches of `data.batch_size`
// sequences, gradients accumulated with scale 1/microbatches, global-norm clipping,
// AdamW with the warmup + cosine schedule. The loss of a step is the mean of its
// microbatch losses.
//
// Expert parallelism (a channel of R > 1 ranks): every rank builds the same model but
// keeps only its shard of the experts (ExpertParallelGroup runs the MoE layers: per
// microbatch and layer, exact loads -> in-band plan -> fan-out -> dispatch -> combine).
// `data.batch_size` is the global microbatch: every rank advances the loader by the whole
// global batch and reads its R-th of the rows; gradients are scaled so that their sum over ranks is
// the gradient of the global mean loss; dense gradients are all-reduced (fixed order, every rank
// bit-identical), expert gradients stay with their master. The same spec on 1, 2 or 4 ranks trains
// the same model up to floating-point reassociation. Rank 0 writes logs and checkpoints (expert
// shards gathered into the single-process checkpoint format, so a run resumes on any number of
// ranks). The auxiliary loss and the selection-bias update use the expert counts over all ranks, so
// they too equal the single-process run.
//
// Expert-parallel domains (parallelism.expert_parallel = G < R): ranks d*G .. d*G+G-1
// form domain d of D = R / G. Experts are sharded over a domain's G ranks (the same
// layout in every domain) and replicated across domains; each domain's
// ExpertParallelGroup plans from its own exact loads on a sub-channel of its G ranks. The
// global batch is still split over all R ranks; dense gradients are all-reduced over all R
// ranks; expert gradients (after the replica -> master reduction inside the domain) are
// all-reduced over the D ranks holding the same shard (a second sub-channel). D x G ranks
// thus train the same model as one rank and as G = R, up to floating-point reassociation.
// Checkpoints gather the shards of domain 0 (every domain holds the same experts), record
// the layout, and keep each domain's balancer state.
//
// Driving it (a CLI process or a worker daemon's job thread): observers see every step on
// every rank (the log line, the JSON log, the worker's progress reports and metrics are
// observers); RequestStop asks for a cooperative stop that every rank takes at the same
// step boundary (they agree through one small all-reduce per step, so no rank is left
// waiting in a collective); phase() and step() may be read from any thread (a heartbeat).
// Thread count, fault injection and the plan source come in TrainerOptions, never from the
// process environment.
//
// Determinism: the model seed and the data order come from `training.seed`; with the
// same spec and thread count two runs give bit-identical losses. A run resumed from the
// checkpoint of step s continues with the bit-identical loss trajectory: checkpoints hold
// parameters, buffers, AdamW moments and step, the position in the data's sample stream
// (data/loader.h: the same on every layout, so a resume on other ranks or domains reads
// exactly the next samples), the data's tokenizer and the model spec, and nothing else in
// the loop carries state.
//
// Data (runtime/job_data.h): data.train or a data.blend of Megatron datasets or token
// files, memory-mapped; every rank reads only its own rows of each global microbatch.
#ifndef RACKRUN_RUNTIME_TRAINER_H_
#define RACKRUN_RUNTIME_TRAINER_H_

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/file.h"
#include "comm/data_channel.h"
#include "data/loader.h"
#include "jobspec/spec.h"
#include "planner/trace.h"
#include "rackrun/v1/job_spec.pb.h"
#include "runtime/device_engine.h"
#include "runtime/expert_parallel.h"
#include "runtime/job_config.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"
#include "runtime/plan_source.h"

namespace rackrun::runtime {

struct Checkpoint;  // checkpoint.h
class StepLog;      // step_log.h

// One optimizer step as logged (a log line and a JSON Lines record).
struct StepRecord {
  int64_t step = 0;  // 1-based: the number of optimizer steps done
  double loss = 0;
  std::optional<double> val_loss;  // set when evaluated at this step
  double tokens_per_s = 0;         // over the steps since the previous record
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double elapsed_s = 0;  // since Run() started, including evaluations and checkpoints
  double aux_loss = 0;
  // Per MoE layer: max / mean tokens per expert in the step's last microbatch.
  std::vector<double> expert_load_max_over_mean;
  // Expert parallelism (ranks > 1): per MoE layer, max / mean tokens per rank with masters
  // only and under the executed plans, averaged over the step's microbatches; replicas per
  // microbatch and layer; rank 0's seconds in the step spent planning (load allgather,
  // solve, invariant check, plan agreement), fanning out replica weights, in token
  // all-to-alls and reducing replica gradients; plan_exchange_s is the part of plan_s spent
  // in the load exchange (the collective, waiting for the other ranks included; with D > 1
  // domains also the all-reduce of the expert totals over the domains, which waits for the
  // other domains: ExpertParallelStats::plan_domains_exchange_s).
  int ranks = 1;
  // The step's gradient and statistics collectives on this rank, each timed around its
  // all-reduce (waiting for the other ranks included): dense gradients over all R ranks;
  // expert gradients over the D ranks holding the same shard (0 with one domain: there is
  // none); the domains' balancing figures (GatherDomainStats: one all-reduce over all
  // ranks with D > 1, none and 0 with one domain). None of them is in plan_s: the plans do
  // not depend on them.
  double dense_allreduce_s = 0, expert_allreduce_s = 0, domain_stats_s = 0;
  std::vector<double> rank_imbalance_before;
  std::vector<double> rank_imbalance_after;
  double replicas = 0;
  double plan_s = 0, plan_exchange_s = 0, fanout_s = 0, dispatch_s = 0, reduce_s = 0;
  // Expert-parallel domains (ranks > 1): G ranks per domain, and every domain's figures of
  // this step in domain order, the same on every rank (D > 1: summed over all ranks after
  // the step's loss, each domain's first rank contributing its domain's block). Per MoE layer
  // its imbalance before/after as rank_imbalance_* (which are this rank's domain's); per
  // rank of the domain the tokens its instances got with masters only / under the plans,
  // summed over layers and microbatches.
  struct Domain {
    std::vector<double> imbalance_before, imbalance_after;
    std::vector<double> rank_tokens_before, rank_tokens_after;
  };
  int expert_parallel = 1;
  std::vector<Domain> domains;
  // This step alone: seconds (without evaluation and checkpoint) and tokens (global).
  double step_s = 0;
  int64_t tokens = 0;
  int64_t total_steps = 0;  // training.steps

  // The record as one JSON object (no trailing newline); step_log.cc.
  std::string ToJson() const;
  // The record as one human log line (no trailing newline); step_log.cc.
  std::string ToLogLine(int64_t steps) const;
  // ToJson's `"expert_parallel": G, "domains": [{imbalance_before, imbalance_after,
  // rank_tokens_before, rank_tokens_after}, ...]` part, with its leading comma; empty
  // without domains.
  std::string DomainsJson() const;
};

// What a rank is doing, for heartbeats and hang reports.
enum class TrainPhase : int {
  kIdle,             // not in Run
  kAgree,            // agreeing with the other ranks whether to stop (a collective)
  kData,             // loading the next microbatch
  kForwardBackward,  // the model's forward and backward, including the MoE layers' planning,
                     // fan-out and token all-to-alls
  kReduce,           // all-reducing dense gradients, the loss and the gradient norm
  kOptimizer,        // the AdamW step
  kEvaluate,         // validation
  kCheckpoint,       // writing (or gathering shards for) a checkpoint
};
const char* TrainPhaseName(TrainPhase phase);

// A checkpoint's "trainer/state" section for `step` with AdamW at `adam_step` (what an
// imported checkpoint, runtime/weights_export.h, starts from).
std::string TrainerStateSection(int64_t step, int64_t adam_step);

// Why Run stopped before training.steps.
enum class StopReason : int {
  kNone = 0,
  kCancel = 1,  // the job was cancelled
  kDrain = 2,   // the process shuts down (SIGTERM): a checkpoint of the stop step is written
};

// Sees a run's steps. Called on the training thread of every rank; an observer must not
// call back into the trainer.
class TrainObserver {
 public:
  virtual ~TrainObserver() = default;
  // After every optimizer step, with its evaluation when one ran at this step (val_loss)
  // and elapsed_s since Run started.
  virtual void OnStep(const StepRecord& record) { (void)record; }
  // After a checkpoint of `step` was written (path empty on ranks other than 0).
  virtual void OnCheckpoint(int64_t step, const std::string& path) {
    (void)step;
    (void)path;
  }
};

struct TrainerOptions {
  // Compute threads; -1 = the spec's resources.threads (0 there = leave as is).
  int threads = -1;
  // Where expert-parallel plans come from; null = in-band. Not owned.
  PlanSource* plan_source = nullptr;
  // Who the run is, recorded in checkpoint.dir/OWNER (CheckpointFolderRun::owner).
  std::string owner;
  // The GPU engine's factory (runtime/cuda/engine.h's GpuEngineFactory()), used when the
  // spec says resources.device: cuda; empty in a program built without it (such a job is
  // then refused as Unimplemented, naming the cause).
  DeviceEngineFactory device_engine;
};

struct TrainSummary {
  int64_t first_step = 0;      // steps done before this run (resume)
  int64_t steps = 0;           // steps done at the end
  std::vector<double> losses;  // per step of this run
  double final_loss = 0;
  double tail_loss = 0;  // mean of the last min(10, steps) losses of this run
  std::optional<double> final_val_loss;
  double train_unigram_entropy = 0;  // nats per token; < 0: unknown
  double tokens_per_s = 0;           // whole run, excluding evaluations and checkpoints
  double elapsed_s = 0;
  int64_t tokens = 0;
  std::string last_checkpoint;             // empty when none was written
  StopReason stopped = StopReason::kNone;  // set when RequestStop ended the run early
};

class Trainer {
 public:
  // Opens the data, builds the model (model.vocab 0 = the data's vocabulary) and
  // the optimizer, and sets the OpenMP thread count (resources.threads, 0 = leave as is).
  // With a `channel` of more than one rank the job is expert-parallel over it (collective:
  // every rank calls Create with the same spec; a rank whose spec differs is named in the
  // error). The channel must outlive the trainer.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const rackrun::v1::JobSpec& spec,
                                                         comm::DataChannel* channel = nullptr,
                                                         const TrainerOptions& options = {});

  // Loads a checkpoint file, or the newest one in a folder (see LoadCheckpointForResume).
  // The checkpoint's model spec must equal this job's, and the tokenizer it recorded the
  // data's (else InvalidArgument naming both). Expert-parallel: each rank takes its
  // expert shard, and the balancer's history (EPLB) is restored when the rank count and
  // balancer settings match; otherwise resume_note() says it starts fresh. A checkpoint
  // without a data position (imported weights) starts the data stream from its beginning,
  // and resume_note() says so.
  absl::Status Resume(const std::string& path);
  // Empty, or what the last Resume could not restore and why (for the log).
  const std::string& resume_note() const { return resume_note_; }

  // Checks and claims every output before the first step; collective, Run calls it when
  // the caller has not. (1) All ranks agree on the resume state: the step and checkpoint
  // checksum every rank resumed from (0 for a fresh start) must be equal, else every rank
  // fails with an error that lists which ranks hold which state. (2) Rank 0 claims
  // checkpoint.dir (ClaimCheckpointFolder: a file or unwritable path is refused, the
  // folder lock is held until Run ends, another run's checkpoints refused unless
  // checkpoint.start_over), then opens logging.json and logging.load_trace: a resumed run
  // first cuts them back to its resume step and then extends them, a fresh run truncates
  // them. Rank 0's failure is every rank's failure (its message is shared).
  absl::Status Prepare();
  // What Prepare did to the outputs (moved checkpoints, removed temporaries), for the log.
  const std::vector<std::string>& notes() const { return notes_; }

  // Runs steps until training.steps, or until a stop every rank agreed on (then
  // summary.stopped says why; a drain writes a checkpoint first when checkpoint.dir is
  // set). Calls Prepare first unless the caller did; releases checkpoint.dir's lock at the
  // end. A write error of a log or trace stops the run at that step. Calls every observer for every
  // step on every rank; rank 0 also writes logging.json (a StepLog, step_log.h). Checkpoints every
  // checkpoint.interval steps and at the end when checkpoint.dir is set.
  absl::StatusOr<TrainSummary> Run(const std::vector<TrainObserver*>& observers = {});

  // Asks Run to stop at the next step boundary. Thread-safe, callable from any thread
  // (a signal handler's thread, the worker's assignment stream). A drain outranks a
  // cancel. Collective in effect: every rank stops at the same step once any rank asked.
  void RequestStop(StopReason reason);
  // What this rank is doing now, and the optimizer steps done; any thread.
  TrainPhase phase() const { return phase_.load(std::memory_order_relaxed); }
  int64_t steps_done() const { return steps_done_.load(std::memory_order_relaxed); }

  // One optimizer step (no logging, no checkpoint). Collective with R > 1.
  absl::StatusOr<StepRecord> Step();
  // Mean loss over training.eval_batches validation microbatches (the same ones every
  // time). FailedPrecondition when the job has no validation data.
  absl::StatusOr<double> EvaluateValidation();
  // Writes a checkpoint of the current step into checkpoint.dir; returns its path (empty
  // on ranks other than 0, which only contribute their expert shards). Collective.
  absl::StatusOr<std::string> SaveCheckpoint();

  int64_t step() const { return step_; }
  // Parameters of the whole model (every rank's expert shard counted once).
  int64_t parameter_count() const;
  int rank() const { return channel_ != nullptr ? channel_->rank() : 0; }
  int ranks() const { return channel_ != nullptr ? channel_->size() : 1; }
  // Expert-parallel degree G (ranks per domain) and data-parallel degree D = ranks() / G.
  int expert_parallel_degree() const { return ranks() / data_parallel_; }
  int data_parallel_degree() const { return data_parallel_; }
  // This rank's index in its domain (its expert shard) and its domain.
  int domain_rank() const { return rank() % expert_parallel_degree(); }
  int domain() const { return rank() / expert_parallel_degree(); }
  // Null in a single-process job.
  ExpertParallelGroup* expert_parallel() { return ep_.get(); }
  double train_unigram_entropy() const { return train_entropy_; }
  int64_t train_tokens() const { return train_loader_->tokens(); }
  int64_t validation_tokens() const {
    return validation_loader_ != nullptr ? validation_loader_->tokens() : 0;
  }
  const data::Loader& train_data() const { return *train_loader_; }
  const rackrun::v1::JobSpec& spec() const { return spec_; }
  const TrainConfig& config() const { return config_; }
  Model<float>& model() { return *model_; }
  // The device engine computing the steps (resources.device: cuda), or null on the CPU.
  DeviceEngine* device_engine() { return engine_.get(); }
  const DeviceEngine* device_engine() const { return engine_.get(); }
  // Several ranks on GPUs whose channels take device buffers (NCCL's): the gradients are
  // reduced, measured and clipped on the devices, never copied to the host. Otherwise a
  // device engine's gradients cross to the host for those (device_engine.h).
  bool reduces_gradients_on_device() const { return device_gradients_; }

 private:
  Trainer() = default;
  // Loads this rank's rows of the next global microbatch into batch_ and returns this
  // rank's share of the counted targets.
  absl::StatusOr<double> NextBatch(data::Loader& loader);
  // Expert-parallel reductions of a step: dense gradients over all ranks, expert gradients
  // over the domains (D > 1); their seconds into r.dense_allreduce_s, r.expert_allreduce_s.
  absl::Status AllReduceGradients(StepRecord& r);
  // Packs the gradients of adam tensors `which` into `packed` (on the device: the engine's
  // buffer), sums them over `channel` and unpacks them; the error names `what` and the step.
  absl::Status AllReducePacked(comm::DataChannel& channel, const std::vector<size_t>& which,
                               std::vector<float>& packed, absl::string_view what);
  // Global gradient norm; expert-parallel: dense part (identical on every rank) plus the
  // expert shards' squares summed over a domain's ranks.
  absl::StatusOr<double> GradNorm();
  // AdamW with learning rate `lr` on the gradients scaled by `grad_scale` (the clipping
  // factor), wherever they are; then the expert-parallel group learns the weights changed.
  absl::Status OptimizerStep(double lr, double grad_scale);
  absl::Status RecordLoads(int64_t microbatch);
  // The last microbatch's expert counts and aux loss, from whichever engine computed it.
  const std::vector<std::vector<int64_t>>& ExpertCounts() const;
  double AuxLoss() const;
  // Expert parallel: every domain's balancing figures of the step into r.domains (D > 1:
  // one all-reduce over all ranks, its seconds into r.domain_stats_s; one domain: none).
  absl::Status GatherDomainStats(StepRecord& r);
  // Step's balancing figures: per-layer imbalance, replicas and planner seconds (expert
  // parallel) and the experts' max/mean load.
  void RecordBalanceStats(StepRecord& r) const;
  // Resume's weights, AdamW moments and buffers from `c` (read from `loaded`).
  absl::Status RestoreTensors(const Checkpoint& c, const std::string& loaded);
  // Run's end: closes logging.json (`json`, or null) and the load traces, whose errors
  // become the run's when `failure` is OK, and frees the checkpoint folder.
  absl::Status EndRun(StepLog* json, absl::Status failure);
  // Prepare's two parts.
  absl::Status AgreeOnResumeState();
  absl::Status PrepareOutputs();
  // Every rank learns whether any rank asked to stop (one all-reduce with R > 1).
  absl::StatusOr<StopReason> AgreeOnStop();
  void SetPhase(TrainPhase phase) { phase_.store(phase, std::memory_order_relaxed); }

  rackrun::v1::JobSpec spec_;
  TrainConfig config_;
  std::unique_ptr<Model<float>> model_;
  std::unique_ptr<AdamW> adam_;
  // resources.device: cuda: computes the steps; model_ and adam_ are then the checkpoint's
  // view of its state (device_engine.h).
  std::unique_ptr<DeviceEngine> engine_;
  std::vector<ParamRef<float>> buffers_;
  std::vector<ParamRef<float>> params_;  // same order as adam_->tensors()
  std::unique_ptr<data::Loader> train_loader_;
  std::unique_ptr<data::Loader> validation_loader_;  // null: no validation data
  double train_entropy_ = 0;
  int64_t step_ = 0;
  int64_t microbatch_ = 0;  // training microbatches run (trace numbering)
  std::string resume_note_;
  std::string resumed_from_;                     // the checkpoint file Resume loaded; empty: fresh
  uint32_t resumed_checksum_ = 0;                // its Checkpoint::checksum
  bool prepared_ = false;                        // Prepare succeeded and Run has not ended since
  std::string owner_;                            // TrainerOptions::owner
  std::optional<base::FolderLock> folder_lock_;  // checkpoint.dir's, rank 0, while prepared
  std::unique_ptr<TrainObserver> json_log_;      // logging.json (a StepLog), rank 0
  std::vector<std::string> notes_;
  data::Batch batch_;
  comm::DataChannel* channel_ = nullptr;  // null or one rank: single process
  int data_parallel_ = 1;                 // D
  // D > 1: this rank's domain (G ranks) and the D ranks holding its shard; else null.
  std::unique_ptr<comm::DataChannel> domain_channel_;
  std::unique_ptr<comm::DataChannel> shard_channel_;
  std::unique_ptr<ExpertParallelGroup> ep_;    // after model_: destroyed first
  std::vector<size_t> dense_;                  // adam tensors all-reduced across ranks
  std::vector<size_t> experts_;                // adam tensors sharded by expert
  std::vector<float> dense_grads_;             // packed for one all-reduce (on the host)
  std::vector<float> expert_grads_;            // packed for one all-reduce across domains
  bool device_gradients_ = false;              // reduces_gradients_on_device()
  std::optional<planner::TraceWriter> trace_;  // single-process load trace
  std::atomic<int> stop_requested_{0};         // a StopReason
  std::atomic<TrainPhase> phase_{TrainPhase::kIdle};
  std::atomic<int64_t> steps_done_{0};
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_TRAINER_H_
