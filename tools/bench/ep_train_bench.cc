// Expert-parallel training with the balancer policies none, ultraep and eplb side by side
// in one run, on one or more D x G layouts of the launched ranks: per-layer and per-rank
// expert load before / after balancing, step time, and the exposed cost of planning,
// fan-out, token all-to-alls, replica-gradient reduction and the gradient all-reduces.
//
//   mpirun --allow-run-as-root --oversubscribe -np 4 bench_ep_train_bench
//          [--spec examples/tiny-moe.yaml] [--steps 30] [--warmup 5]
//          [--policies none,ultraep,eplb] [--layouts all|1x4,2x2,4x1]
//          [--set FIELD=VALUE]... [--json]
//
// Layouts (issue 24): DxG = D expert-parallel domains of G ranks (parallelism.expert_parallel
// = G; ranks d*G .. d*G+G-1 are domain d). D * G must be the launched ranks and G must divide
// model.moe.experts, else the bench stops naming --layouts before any trainer starts; `all`
// is every such layout (G descending: 1xR first). Default: the one layout of the spec (and
// --set parallelism.expert_parallel). Every (layout, policy) gets a fresh Trainer from the
// same spec and seed (so the same initial weights, data order and routing) and runs
// --warmup unmeasured then --steps measured optimizer steps through Trainer::Step(). All
// trainers live side by side and take turns, one step each (1x4 none, 1x4 ultraep, 2x2
// none, ...), so that the shared machine's load drifting during the run does not favour the
// layout or policy that ran at a quiet moment. The
// bench's defaults come before the user's --set overrides: model.moe.aux_loss_coef=0 (real
// routing skew) and resources.threads=1 (one compute thread per rank). It then forces: no
// checkpoints, no validation data, balancer.policy per trainer, and a load trace
// (logging.load_trace) in a temporary folder.
//
// Figures (all from what the runtime exposes; nothing in runtime/ is changed):
// - step time: wall clock around Step() on every rank, max over ranks per step; median and
//   p90 over the measured steps; tokens/s = global tokens per step / median step.
// - exposed cost: ExpertParallelStats plan_s, fanout_s, dispatch_s, reduce_s (and expert_s)
//   per step, max over ranks (gathered with the channel's Allgather), median over steps, and
//   the median over steps of (that / the step's time) as a percentage. These phases run
//   synchronously on the critical path, so all of their time is exposed, including the wait
//   for the slowest rank at each collective; the same median of the MIN over ranks is given
//   beside it as an estimate with less of that wait. plan_s includes the load allgather
//   (which also carries each rank's fingerprint of its previous plan); fan-out is the time
//   spent posting and completing fan-outs (they travel during the token dispatch, the
//   masters' compute and, for backward refetches, the layer above's backward); the
//   balancing overhead is plan + fan-out + grad reduce (max over ranks per phase, and the
//   min over ranks per phase beside it), with the policy's median step over `none`'s. The
//   plan phase is also split: its load exchange (ExpertParallelStats::plan_exchange_s, the
//   allgather with the wait for the other ranks; with D > 1 domains also the all-reduce of
//   the expert totals over the domains, plan_domains_exchange in the JSON, which waits for
//   the other domains) and the rest (max over ranks of plan minus
//   exchange: solve, invariant check, statistics); "without the load exchange" is that rest
//   + fan-out + grad reduce, and "over none's" is the median over steps of the policy's
//   plan + fan-out + grad reduce minus `none`'s in the same step (`none` makes the same
//   exchange, so what it pays there is the price of any expert-parallel dispatch). The
//   pure solve + invariant check is timed separately by replaying the recorded load trace
//   through a planner of the same policy and options on rank 0 after the run.
// - per-layer rank imbalance (max / mean rank load): ExpertParallelStats::layers sums
//   (masters only, and under the executed plan), mean over measured microbatches; rank 0's,
//   i.e. domain 0's with D > 1.
// - per-rank expert rows per microbatch (summed over MoE layers): before = home-rank loads
//   of the recorded load matrices (domain 0's ranks: rank 0 records domain 0's loads);
//   after = ExpertParallelStats::expert_rows of every rank (max/mean over domain 0's).
//   The replayed plans' RankLoads must reproduce expert_rows exactly on every rank of
//   domain 0; the bench checks it and reports the result (it also yields after-loads per
//   layer and rank).
// - loss: the final measured step's loss per policy and the max relative difference vs
//   `none` of the same layout over all steps run (and vs the same policy on the first
//   layout: D x G trains the same model, up to floating-point reassociation).
// - per layout (the "D x G layouts" table; StepRecord's own timings, max over ranks per
//   step, median over steps): the dense-gradient all-reduce over all ranks
//   (dense_allreduce_s), the expert-gradient all-reduce over the D ranks holding a shard
//   (expert_allreduce_s; 0 with D = 1) and the all-reduce of the domains' balancing figures
//   (domain_stats_s; 0 with D = 1), each with its median share of the step; the balancing
//   share (plan + fan-out + grad reduce, as above); the step's median over the first
//   layout's for the same policy; and the worst domain's rank imbalance (max/mean tokens
//   per rank) before and after balancing: per domain the mean over measured steps and MoE
//   layers of StepRecord::domains (every domain's figures, the same on every rank), max
//   over domains. The per-layer and per-rank tables below it, and the replay, are domain
//   0's (rank 0 writes domain 0's load trace).
//
// GPUs: with --set resources.device=cuda every rank trains on its launcher's local rank's GPU
// (the GPU engine, expert parallelism host-staged: runtime/cuda/expert_instances.h), so the
// tables give the balancing's cost on GPU ranks; a build without the GPU engine refuses it,
// saying so. Not run on a GPU yet.
//
// OpenMP wait policy: as in train_step_bench, the bench re-executes itself with
// OMP_WAIT_POLICY=passive when the variable is unset (spinning threads are very costly on
// an oversubscribed machine).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/clock.h"
#include "base/statistics.h"
#include "comm/data_channel.h"
#include "comm/mpi_channel.h"
#include "jobspec/balancer.h"
#include "jobspec/spec.h"
#include "nlohmann/json.hpp"
#include "planner/invariants.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "planner/trace.h"
#include "runtime/cuda/engine.h"
#include "runtime/expert_parallel.h"
#include "runtime/job_config.h"
#include "runtime/trainer.h"
#include "tools/bench/startup.h"

namespace {

using rackrun::base::MaxOverMean;
using rackrun::base::Median;
using rackrun::base::Percentile;

namespace comm = rackrun::comm;
namespace planner = rackrun::planner;
namespace rt = rackrun::runtime;

// A fatal error on any rank ends the whole job (peers would wait out their timeouts).
template <typename T>
T OrDie(absl::StatusOr<T> v, int rank, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "rank %d: %s: %s\n", rank, what,
                 std::string(v.status().message()).c_str());
    comm::AbortJob(1);
  }
  return *std::move(v);
}
void OrDie(const absl::Status& s, int rank, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "rank %d: %s: %s\n", rank, what, std::string(s.message()).c_str());
    comm::AbortJob(1);
  }
}

struct Options {
  std::string spec = "examples/tiny-moe.yaml";
  int steps = 30;
  int warmup = 5;
  std::vector<std::string> policies = {"none", "ultraep", "eplb"};
  std::vector<std::string> layouts;  // empty: the spec's
  std::vector<std::string> overrides;
};

// D x G: D expert-parallel domains of G ranks.
struct Layout {
  int d = 1, g = 1;
  std::string Name() const { return std::to_string(d) + "x" + std::to_string(g); }
};

// --layouts on `ranks` ranks with `experts` experts: the layouts, or a message naming
// --layouts and the fix. `asked_g` is the spec's parallelism.expert_parallel (0 = all
// ranks), the layout when --layouts is not given.
absl::StatusOr<std::vector<Layout>> ParseLayouts(const std::vector<std::string>& list, int ranks,
                                                 int experts, int asked_g) {
  std::vector<Layout> out;
  const std::string fix = "use D x G with D * G = " + std::to_string(ranks) +
                          " (the launched ranks) and G dividing model.moe.experts (" +
                          std::to_string(experts) + "), e.g. --layouts all";
  if (list.empty()) {
    const int g = asked_g > 0 ? asked_g : ranks;
    if (g > ranks || ranks % g != 0 || experts % g != 0) {
      // The trainer names parallelism.expert_parallel; say so early.
      return absl::InvalidArgumentError("parallelism.expert_parallel=" + std::to_string(asked_g) +
                                        " does not fit " + std::to_string(ranks) + " ranks and " +
                                        std::to_string(experts) + " experts; " + fix);
    }
    out.push_back({ranks / g, g});
    return out;
  }
  if (list.size() == 1 && list[0] == "all") {
    for (int g = ranks; g >= 1; --g) {
      if (ranks % g == 0 && experts % g == 0) out.push_back({ranks / g, g});
    }
    return out;
  }
  for (const std::string& item : list) {
    const size_t x = item.find('x');
    int d = 0, g = 0;
    size_t used_d = 0, used_g = 0;
    bool parsed = x != std::string::npos && x > 0 && x + 1 < item.size();
    if (parsed) {
      try {
        d = std::stoi(item.substr(0, x), &used_d);
        g = std::stoi(item.substr(x + 1), &used_g);
      } catch (const std::exception&) {
        parsed = false;
      }
      parsed = parsed && used_d == x && used_g == item.size() - x - 1;
    }
    if (!parsed || d < 1 || g < 1) {
      return absl::InvalidArgumentError("--layouts: '" + item +
                                        "' is not DxG with positive D and G (or all); " + fix);
    }
    if (d * g != ranks) {
      return absl::InvalidArgumentError("--layouts: " + item + " is " + std::to_string(d * g) +
                                        " ranks but the bench runs on " + std::to_string(ranks) +
                                        " (mpirun -np); " + fix);
    }
    if (experts % g != 0) {
      return absl::InvalidArgumentError("--layouts: " + item + ": G = " + std::to_string(g) +
                                        " does not divide model.moe.experts (" +
                                        std::to_string(experts) + "); " + fix);
    }
    for (const Layout& l : out) {
      if (l.g == g) {
        return absl::InvalidArgumentError("--layouts: " + item + " is listed twice; " + fix);
      }
    }
    out.push_back({d, g});
  }
  return out;
}

// Per-rank figures of one step, gathered from every rank (this order on the wire).
enum Field {
  kStep,
  kPlan,
  kPlanExchange,
  kFanout,
  kDispatch,
  kExpert,
  kReduce,
  kRows,
  kFanoutBytes,
  kReduceBytes,
  kFanouts,
  kFanoutsSkipped,
  kDenseAllreduce,
  kExpertAllreduce,
  kDomainStats,
  kPlanDomainsExchange,
  kFields
};

struct PolicyResult {
  std::string policy;
  Layout layout;
  // Per measured step: max over ranks of each phase, and the per-rank values of some.
  std::vector<double> step_s, plan_s, fanout_s, dispatch_s, expert_s, reduce_s, expert_mean_s;
  // Per measured step, max over ranks: the plan phase's load exchange (the collective, with
  // the wait for the other ranks), and the rest of the plan phase (solve, invariant check).
  std::vector<double> exchange_s, plan_local_s;
  // Per measured step: min over ranks (the last rank to arrive at a collective waits least,
  // so this approaches the phase's own cost without the wait for stragglers).
  std::vector<double> plan_min_s, exchange_min_s, fanout_min_s, dispatch_min_s, reduce_min_s;
  // Per measured step, max over ranks: the step's all-reduces (StepRecord): dense gradients
  // over all ranks, expert gradients across the domains, the domains' balancing figures.
  std::vector<double> dense_s, expert_ar_s, domain_stats_s;
  // Per measured step, max over ranks: of the plan phase's exchange, the all-reduce of the
  // expert totals over the domains (ExpertParallelStats::plan_domains_exchange_s).
  std::vector<double> domains_exchange_s;
  // Per domain: rank imbalance before / after balancing, mean over measured steps and MoE
  // layers (StepRecord::domains).
  std::vector<double> domain_imbalance_before, domain_imbalance_after;
  std::vector<double> losses;  // every step run, warmup included
  // Per MoE layer, mean over measured microbatches (ExpertParallelStats::layers).
  std::vector<double> imbalance_before, imbalance_after, replicas;
  // Per rank, rows per measured microbatch summed over layers.
  std::vector<double> rows_before, rows_after;
  // Per layer x rank, rows per measured microbatch (from the trace and its replay).
  std::vector<std::vector<double>> layer_rows_before, layer_rows_after;
  double fanout_bytes = 0, reduce_bytes = 0;  // per measured step, summed over ranks
  double fanouts = 0, fanouts_skipped = 0;    // per measured step, summed over ranks
  // Replay on rank 0: solve + invariant check seconds per measured step (median).
  double solve_s = 0;
  bool replay_matches_rows = false;
  double replay_imbalance_diff = 0;  // max |replayed - runtime| per-layer imbalance_after
  std::string replay_note;
  int64_t measured_microbatches = 0;
};

// Replays the load trace of one run through a planner configured as the runtime's and
// fills the per-layer/per-rank loads and solve times of `out` (rank 0 only).
void Replay(const std::string& trace_path, const planner::Domain& domain,
            const rackrun::v1::JobSpec& spec, const std::string& policy, int64_t first_measured,
            int microbatches, const std::vector<double>& rows_after_sum, PolicyResult& out) {
  absl::StatusOr<std::vector<planner::TraceEntry>> trace = planner::ReadTrace(trace_path);
  if (!trace.ok()) {
    out.replay_note = "trace unreadable: " + std::string(trace.status().message());
    return;
  }
  // The runtime's balancer: the same setup the trainer built its planner from.
  absl::StatusOr<rackrun::jobspec::BalancerSetup> balancer =
      rackrun::jobspec::BalancerSetupOf(spec, domain.ranks);
  if (!balancer.ok()) {
    out.replay_note = std::string(balancer.status().message());
    return;
  }
  absl::StatusOr<std::unique_ptr<planner::Planner>> p =
      planner::MakePlanner(policy, domain, balancer->planner);
  if (!p.ok()) {
    out.replay_note = std::string(p.status().message());
    return;
  }
  const planner::InvariantOptions inv = balancer->invariants;
  const int layers = spec.model().blocks();
  const int ranks = domain.ranks;
  std::vector<std::vector<double>> before(static_cast<size_t>(layers),
                                          std::vector<double>(static_cast<size_t>(ranks), 0));
  auto after = before;
  std::vector<double> imbalance_after(static_cast<size_t>(layers), 0);
  std::vector<double> solve_per_step;
  planner::Plan plan;
  for (const planner::TraceEntry& e : *trace) {
    const double t0 = rackrun::base::NowSeconds();
    if (absl::Status s = (*p)->SolveInto(e.loads, e.layer, &plan); !s.ok()) {
      out.replay_note = "replay failed: " + std::string(s.message());
      return;
    }
    if (absl::Status s = planner::CheckPlanInvariants(domain, e.loads, plan, inv); !s.ok()) {
      out.replay_note = "replayed plan breaks an invariant: " + std::string(s.message());
      return;
    }
    const double t1 = rackrun::base::NowSeconds();
    if (e.microbatch < first_measured) continue;
    const auto step = static_cast<size_t>((e.microbatch - first_measured) / microbatches);
    if (solve_per_step.size() <= step) solve_per_step.resize(step + 1, 0);
    solve_per_step[step] += t1 - t0;
    const std::vector<int64_t> home = planner::HomeRankLoads(domain, e.loads);
    const std::vector<int64_t> executed = plan.RankLoads();
    const auto l = static_cast<size_t>(e.layer);
    for (int r = 0; r < ranks; ++r) {
      before[l][static_cast<size_t>(r)] += static_cast<double>(home[static_cast<size_t>(r)]);
      after[l][static_cast<size_t>(r)] += static_cast<double>(executed[static_cast<size_t>(r)]);
    }
    imbalance_after[l] += planner::Imbalance(executed);
  }
  const auto n = static_cast<double>(std::max<int64_t>(out.measured_microbatches, 1));
  out.rows_before.assign(static_cast<size_t>(ranks), 0);
  out.replay_matches_rows = true;
  std::vector<double> replay_rows(static_cast<size_t>(ranks), 0);
  for (int l = 0; l < layers; ++l) {
    for (int r = 0; r < ranks; ++r) {
      out.rows_before[static_cast<size_t>(r)] +=
          before[static_cast<size_t>(l)][static_cast<size_t>(r)] / n;
      replay_rows[static_cast<size_t>(r)] += after[static_cast<size_t>(l)][static_cast<size_t>(r)];
      before[static_cast<size_t>(l)][static_cast<size_t>(r)] /= n;
      after[static_cast<size_t>(l)][static_cast<size_t>(r)] /= n;
    }
    if (static_cast<size_t>(l) < out.imbalance_after.size()) {
      out.replay_imbalance_diff = std::max(out.replay_imbalance_diff,
                                           std::abs(imbalance_after[static_cast<size_t>(l)] / n -
                                                    out.imbalance_after[static_cast<size_t>(l)]));
    }
  }
  for (int r = 0; r < ranks; ++r) {
    // Both are integer row counts summed in doubles far below 2^53: exact.
    if (replay_rows[static_cast<size_t>(r)] != rows_after_sum[static_cast<size_t>(r)]) {
      out.replay_matches_rows = false;
    }
  }
  out.layer_rows_before = std::move(before);
  out.layer_rows_after = std::move(after);
  out.solve_s = Median(solve_per_step);
}

// One policy's trainer and its accumulators. Policies run interleaved, one optimizer step
// each in turn, so that a change in the shared machine's load hits all of them alike.
class PolicyRun {
 public:
  PolicyRun(comm::DataChannel& channel, const Options& o, const std::vector<std::string>& overrides,
            const Layout& layout, const std::string& policy, const std::string& trace_dir)
      : channel_(channel), o_(o), rank_(channel.rank()), ranks_(channel.size()) {
    // The policy and layout go in as overrides, so that the defaults that depend on them
    // (balancer.shared_slots) follow them.
    std::vector<std::string> with_policy = overrides;
    with_policy.push_back("balancer.policy=" + policy);
    with_policy.push_back("parallelism.expert_parallel=" + std::to_string(layout.g));
    spec_ = OrDie(rackrun::jobspec::LoadJobSpec(o.spec, with_policy), rank_, "job spec");
    spec_.mutable_checkpoint()->clear_dir();
    spec_.mutable_data()->clear_validation();
    spec_.mutable_logging()->clear_json();
    trace_path_ = trace_dir + "/" + layout.Name() + "-" + policy + ".trace";
    spec_.mutable_logging()->set_load_trace(trace_path_);
    res_.policy = policy;
    res_.layout = layout;
    rt::TrainerOptions options;
    options.device_engine = rt::cuda::GpuEngineFactory();  // resources.device: cuda
    trainer_ = OrDie(rt::Trainer::Create(spec_, &channel, options), rank_, "creating the trainer");
    // Step() alone opens no output: Prepare opens logging.load_trace (Run would call it).
    OrDie(trainer_->Prepare(), rank_, "preparing the trainer's outputs");
    ep_ = trainer_->expert_parallel();
    if (ep_ == nullptr) {
      std::fprintf(stderr, "rank %d: the trainer is not expert-parallel\n", rank_);
      comm::AbortJob(1);
    }
    domain_ = ep_->domain();
    if (trainer_->data_parallel_degree() != layout.d ||
        trainer_->expert_parallel_degree() != layout.g) {
      std::fprintf(stderr, "rank %d: the trainer runs %d x %d, not the layout %s\n", rank_,
                   trainer_->data_parallel_degree(), trainer_->expert_parallel_degree(),
                   layout.Name().c_str());
      comm::AbortJob(1);
    }
    micro_ = trainer_->config().microbatches;
    const auto layers = static_cast<size_t>(spec_.model().blocks());
    before_sum_.assign(layers, 0);
    after_sum_.assign(layers, 0);
    replicas_sum_.assign(layers, 0);
    rows_after_sum_.assign(static_cast<size_t>(ranks_), 0);
    domain_before_sum_.assign(static_cast<size_t>(layout.d), 0);
    domain_after_sum_.assign(static_cast<size_t>(layout.d), 0);
  }

  const rackrun::v1::JobSpec& spec() const { return spec_; }

  // Optimizer step `s` (0-based; steps below --warmup are not measured). Collective.
  void Step(int s) {
    const double t0 = rackrun::base::NowSeconds();
    const rt::StepRecord r = OrDie(trainer_->Step(), rank_, "training step");
    const double step_s = rackrun::base::NowSeconds() - t0;
    res_.losses.push_back(r.loss);
    if (s < o_.warmup) return;
    const rt::ExpertParallelStats& st = ep_->stats();
    std::vector<double> mine = {step_s,
                                st.plan_s,
                                st.plan_exchange_s,
                                st.fanout_s,
                                st.dispatch_s,
                                st.expert_s,
                                st.reduce_s,
                                static_cast<double>(st.expert_rows),
                                static_cast<double>(st.fanout_bytes),
                                static_cast<double>(st.reduce_bytes),
                                static_cast<double>(st.fanouts),
                                static_cast<double>(st.fanouts_skipped),
                                r.dense_allreduce_s,
                                r.expert_allreduce_s,
                                r.domain_stats_s,
                                st.plan_domains_exchange_s};
    std::vector<double> all(static_cast<size_t>(kFields * ranks_));
    OrDie(channel_.Allgather(mine.data(), all.data(), kFields, comm::DataType::kFloat64), rank_,
          "gathering step figures");
    auto at = [&](int q, Field f) { return all[static_cast<size_t>(q * kFields + f)]; };
    auto max_of = [&](Field f) {
      double m = at(0, f);
      for (int q = 1; q < ranks_; ++q) m = std::max(m, at(q, f));
      return m;
    };
    auto min_of = [&](Field f) {
      double m = at(0, f);
      for (int q = 1; q < ranks_; ++q) m = std::min(m, at(q, f));
      return m;
    };
    auto sum_of = [&](Field f) {
      double m = 0;
      for (int q = 0; q < ranks_; ++q) m += at(q, f);
      return m;
    };
    res_.step_s.push_back(max_of(kStep));
    res_.plan_s.push_back(max_of(kPlan));
    res_.exchange_s.push_back(max_of(kPlanExchange));
    double local = 0;
    for (int q = 0; q < ranks_; ++q) local = std::max(local, at(q, kPlan) - at(q, kPlanExchange));
    res_.plan_local_s.push_back(local);
    res_.fanout_s.push_back(max_of(kFanout));
    res_.dispatch_s.push_back(max_of(kDispatch));
    res_.expert_s.push_back(max_of(kExpert));
    res_.expert_mean_s.push_back(sum_of(kExpert) / ranks_);
    res_.reduce_s.push_back(max_of(kReduce));
    res_.plan_min_s.push_back(min_of(kPlan));
    res_.exchange_min_s.push_back(min_of(kPlanExchange));
    res_.fanout_min_s.push_back(min_of(kFanout));
    res_.dispatch_min_s.push_back(min_of(kDispatch));
    res_.reduce_min_s.push_back(min_of(kReduce));
    res_.dense_s.push_back(max_of(kDenseAllreduce));
    res_.expert_ar_s.push_back(max_of(kExpertAllreduce));
    res_.domain_stats_s.push_back(max_of(kDomainStats));
    res_.domains_exchange_s.push_back(max_of(kPlanDomainsExchange));
    // Every domain's figures (the same on every rank): mean over the step's MoE layers.
    if (r.domains.size() != domain_after_sum_.size()) {
      std::fprintf(stderr, "rank %d: the step reports %zu domains, the layout has %zu\n", rank_,
                   r.domains.size(), domain_after_sum_.size());
      comm::AbortJob(1);
    }
    auto layer_mean = [](const std::vector<double>& v) {
      double sum = 0;
      for (const double x : v) sum += x;
      return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
    };
    for (size_t d = 0; d < r.domains.size(); ++d) {
      domain_before_sum_[d] += layer_mean(r.domains[d].imbalance_before);
      domain_after_sum_[d] += layer_mean(r.domains[d].imbalance_after);
    }
    res_.fanout_bytes += sum_of(kFanoutBytes);
    res_.reduce_bytes += sum_of(kReduceBytes);
    res_.fanouts += sum_of(kFanouts);
    res_.fanouts_skipped += sum_of(kFanoutsSkipped);
    for (int q = 0; q < ranks_; ++q) rows_after_sum_[static_cast<size_t>(q)] += at(q, kRows);
    for (size_t l = 0; l < before_sum_.size() && l < st.layers.size(); ++l) {
      before_sum_[l] += st.layers[l].imbalance_before;
      after_sum_[l] += st.layers[l].imbalance_after;
      replicas_sum_[l] += static_cast<double>(st.layers[l].replicas);
    }
    if (!st.layers.empty()) measured_mb_ += st.layers[0].microbatches;
  }

  // Destroys the trainer (flushing the load trace) and, on rank 0, replays the trace.
  PolicyResult Finish() {
    OrDie(ep_->Close(), rank_, "closing the load trace");
    ep_ = nullptr;
    trainer_.reset();
    res_.measured_microbatches = measured_mb_;
    const auto n = static_cast<double>(std::max<int64_t>(measured_mb_, 1));
    for (size_t l = 0; l < before_sum_.size(); ++l) {
      res_.imbalance_before.push_back(before_sum_[l] / n);
      res_.imbalance_after.push_back(after_sum_[l] / n);
      res_.replicas.push_back(replicas_sum_[l] / n);
    }
    for (const double rows : rows_after_sum_) res_.rows_after.push_back(rows / n);
    const auto steps = static_cast<double>(std::max(o_.steps, 1));
    for (size_t d = 0; d < domain_after_sum_.size(); ++d) {
      res_.domain_imbalance_before.push_back(domain_before_sum_[d] / steps);
      res_.domain_imbalance_after.push_back(domain_after_sum_[d] / steps);
    }
    res_.fanout_bytes /= steps;
    res_.reduce_bytes /= steps;
    res_.fanouts /= steps;
    res_.fanouts_skipped /= steps;
    if (rank_ == 0) {
      Replay(trace_path_, domain_, spec_, res_.policy, static_cast<int64_t>(o_.warmup) * micro_,
             micro_, rows_after_sum_, res_);
      std::error_code ec;
      std::filesystem::remove(trace_path_, ec);
    }
    return res_;
  }

 private:
  comm::DataChannel& channel_;
  const Options& o_;
  int rank_, ranks_;
  rackrun::v1::JobSpec spec_;
  std::string trace_path_;
  std::unique_ptr<rt::Trainer> trainer_;
  rt::ExpertParallelGroup* ep_ = nullptr;
  planner::Domain domain_;
  int micro_ = 1;
  std::vector<double> before_sum_, after_sum_, replicas_sum_, rows_after_sum_;
  std::vector<double> domain_before_sum_, domain_after_sum_;  // per domain, over steps
  int64_t measured_mb_ = 0;
  PolicyResult res_;
};

// Balancing overhead per step: plan + fan-out + replica-gradient reduction.
enum class Overhead {
  kMax,         // each phase the max over ranks
  kMinRank,     // each phase the min over ranks (the rank that reached each collective
                // last, so little of the wait for the slowest rank is in it)
  kNoExchange,  // as kMax, but the plan phase without its load exchange
};

std::vector<double> OverheadPerStep(const PolicyResult& r, Overhead kind) {
  const bool min_rank = kind == Overhead::kMinRank;
  const std::vector<double>& plan = kind == Overhead::kNoExchange ? r.plan_local_s
                                    : min_rank                    ? r.plan_min_s
                                                                  : r.plan_s;
  const std::vector<double>& fanout = min_rank ? r.fanout_min_s : r.fanout_s;
  const std::vector<double>& reduce = min_rank ? r.reduce_min_s : r.reduce_s;
  std::vector<double> s;
  for (size_t i = 0; i < r.step_s.size(); ++i) s.push_back(plan[i] + fanout[i] + reduce[i]);
  return s;
}

// {median seconds, median % of the step} over the measured steps of `per_step` (one value per
// measured step of `r`).
std::pair<double, double> MedianAndShare(const PolicyResult& r,
                                         const std::vector<double>& per_step) {
  std::vector<double> f;
  for (size_t i = 0; i < r.step_s.size() && i < per_step.size(); ++i) {
    f.push_back(r.step_s[i] > 0 ? 100 * per_step[i] / r.step_s[i] : 0);
  }
  return {Median(per_step), Median(f)};
}

std::pair<double, double> BalancingOverhead(const PolicyResult& r, Overhead kind = Overhead::kMax) {
  return MedianAndShare(r, OverheadPerStep(r, kind));
}

// What the policy's plan + fan-out + grad reduce (max over ranks) costs beyond `none`'s in
// the same steps (the policies take turns step by step, so step i of both ran side by side):
// `none` makes the same load exchange, so its plan phase is mostly the wait for the slower
// rank that every expert-parallel dispatch pays. Median over steps of the difference.
std::pair<double, double> OverheadOverNone(const PolicyResult& r, const PolicyResult& none) {
  const std::vector<double> mine = OverheadPerStep(r, Overhead::kMax);
  const std::vector<double> theirs = OverheadPerStep(none, Overhead::kMax);
  std::vector<double> d;
  for (size_t i = 0; i < mine.size() && i < theirs.size(); ++i) d.push_back(mine[i] - theirs[i]);
  return MedianAndShare(r, d);
}

// rows_after of domain 0's ranks (the ranks rows_before, from domain 0's trace, covers).
std::vector<double> Domain0RowsAfter(const PolicyResult& r) {
  const size_t n = std::min(r.rows_after.size(), static_cast<size_t>(r.layout.g));
  return std::vector<double>(r.rows_after.begin(),
                             r.rows_after.begin() + static_cast<std::ptrdiff_t>(n));
}

double MaxOf(const std::vector<double>& v) {
  return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end());
}

// The exposed communication / balancing phase with the largest median.
std::string DominantPhase(const PolicyResult& r) {
  const std::pair<const char*, const std::vector<double>*> phases[] = {
      {"plan", &r.plan_s},
      {"fan-out", &r.fanout_s},
      {"grad reduce", &r.reduce_s},
      {"all-to-all", &r.dispatch_s}};
  const char* best = "";
  double best_s = -1;
  for (const auto& [name, v] : phases) {
    if (const double m = Median(*v); m > best_s) {
      best_s = m;
      best = name;
    }
  }
  return best;
}

// 2. The layouts of --layouts, checked before any trainer starts (every rank decides
// alike); nothing when there is none (rank 0 printed why).
std::optional<std::vector<Layout>> CheckedLayouts(const Options& o,
                                                  const std::vector<std::string>& overrides,
                                                  int rank, int ranks) {
  const rackrun::v1::JobSpec base =
      OrDie(rackrun::jobspec::LoadJobSpec(o.spec, overrides), rank, "job spec");
  absl::StatusOr<std::vector<Layout>> parsed = ParseLayouts(
      o.layouts, ranks, base.model().moe().experts(), base.parallelism().expert_parallel());
  if (!parsed.ok() || parsed->empty()) {
    if (rank == 0) {
      std::fprintf(stderr, "ep_train_bench: %s\n",
                   parsed.ok() ? "--layouts: no D x G layout fits these ranks and experts"
                               : std::string(parsed.status().message()).c_str());
    }
    return std::nullopt;
  }
  return *std::move(parsed);
}

// 2. One temporary folder for the load traces, named by rank 0 and broadcast (every rank's
// spec must match).
void MakeTraceFolder(comm::DataChannel& channel, int rank, char (&dir)[256]) {
  if (rank == 0) {
    std::snprintf(dir, sizeof(dir), "/tmp/ep_train_bench.XXXXXX");
    if (mkdtemp(dir) == nullptr) {
      std::perror("mkdtemp");
      comm::AbortJob(1);
    }
  }
  OrDie(channel.Broadcast(dir, sizeof(dir), comm::DataType::kByte, 0), rank, "broadcast");
}

// 3. The runs' results, the spec they share, their wall seconds and the load average
// before and after.
struct Runs {
  std::vector<PolicyResult> results;
  rackrun::v1::JobSpec spec;
  double wall = 0, load_start = 0, load_end = 0;
};

// 3. A fresh trainer per layout and policy, all stepped in turn.
Runs RunInterleaved(comm::DataChannel& channel, const Options& o,
                    const std::vector<std::string>& overrides, const std::vector<Layout>& layouts,
                    const char* dir) {
  Runs out;
  const double start = rackrun::base::NowSeconds();
  out.load_start = rackrun::bench::LoadAverage();
  std::vector<std::unique_ptr<PolicyRun>> runs;
  for (const Layout& layout : layouts) {
    for (const std::string& policy : o.policies) {
      runs.push_back(std::make_unique<PolicyRun>(channel, o, overrides, layout, policy, dir));
    }
  }
  out.spec = runs.front()->spec();
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    for (auto& run : runs) run->Step(s);
  }
  for (auto& run : runs) out.results.push_back(run->Finish());
  runs.clear();
  out.wall = rackrun::base::NowSeconds() - start;
  out.load_end = rackrun::bench::LoadAverage();
  return out;
}

double MaxRelDiff(const PolicyResult& r, const PolicyResult* base) {
  double d = 0;
  if (base == nullptr) return d;
  for (size_t i = 0; i < r.losses.size() && i < base->losses.size(); ++i) {
    d = std::max(d, std::abs(r.losses[i] - base->losses[i]) / std::abs(base->losses[i]));
  }
  return d;
}

// The median share of the step (per step) that `phase` takes, in percent.
double Share(const std::vector<double>& phase, const std::vector<double>& step) {
  std::vector<double> f;
  for (size_t i = 0; i < phase.size(); ++i) f.push_back(step[i] > 0 ? phase[i] / step[i] : 0);
  return 100 * Median(f);
}

// 4. What rank 0 reports from: the run's settings, the machine and the results.
struct Report {
  const Options& o;
  const std::vector<std::string>& overrides;
  const std::vector<Layout>& layouts;
  const std::vector<PolicyResult>& results;
  const rackrun::v1::JobSpec& spec;
  rt::TrainConfig config;
  int ranks;
  int threads;
  unsigned cores;
  bool oversubscribed;
  double tokens_per_step;
  int layers;
  bool many_layouts;
  double load_start, load_end, wall;

  // The baseline of a result: the policy that does not balance, on the same layout.
  const PolicyResult* NoneOf(const PolicyResult& r) const {
    for (const PolicyResult& q : results) {
      const planner::PolicyTraits* traits = planner::FindPolicy(q.policy);
      if (q.layout.g == r.layout.g && traits != nullptr &&
          traits->split == planner::TokenSplit::kMastersOnly) {
        return &q;
      }
    }
    return nullptr;
  }
  // The same policy on the first layout (the reference of the layouts table).
  const PolicyResult* FirstLayoutOf(const PolicyResult& r) const {
    for (const PolicyResult& q : results) {
      if (q.layout.g == layouts.front().g && q.policy == r.policy) return &q;
    }
    return nullptr;
  }
  double RelDiff(const PolicyResult& r) const { return MaxRelDiff(r, NoneOf(r)); }
  // A row's name: the policy, with its layout when several run.
  std::string Label(const PolicyResult& r) const {
    return many_layouts ? r.layout.Name() + " " + r.policy : r.policy;
  }
};

// 5. One policy's object of the JSON document.
nlohmann::json PolicyJson(const Report& rep, const PolicyResult& r) {
  const PolicyResult* none = rep.NoneOf(r);
  nlohmann::json p;
  p["policy"] = r.policy;
  p["layout"] = r.layout.Name();
  p["data_parallel"] = r.layout.d;
  p["expert_parallel"] = r.layout.g;
  p["step_s_median"] = Median(r.step_s);
  p["step_s_p90"] = Percentile(r.step_s, 0.9);
  p["tokens_per_s"] = rep.tokens_per_step / Median(r.step_s);
  p["final_loss"] = r.losses.back();
  p["losses"] = r.losses;
  p["max_rel_loss_diff_vs_none"] = rep.RelDiff(r);
  if (const PolicyResult* first = rep.FirstLayoutOf(r)) {
    p["max_rel_loss_diff_vs_first_layout"] = MaxRelDiff(r, first);
    p["median_step_over_first_layout"] = Median(r.step_s) / Median(first->step_s);
  }
  p["step_s"] = r.step_s;
  struct Phase {
    const char* name;
    const std::vector<double>*max, *min;
  };
  for (const Phase& ph :
       {Phase{"plan", &r.plan_s, &r.plan_min_s}, Phase{"fanout", &r.fanout_s, &r.fanout_min_s},
        Phase{"dispatch", &r.dispatch_s, &r.dispatch_min_s},
        Phase{"reduce", &r.reduce_s, &r.reduce_min_s}, Phase{"expert", &r.expert_s, nullptr}}) {
    p["exposed"][ph.name] = {{"median_s", Median(*ph.max)},
                             {"median_pct_of_step", Share(*ph.max, r.step_s)}};
    if (ph.min != nullptr) p["exposed"][ph.name]["min_rank_median_s"] = Median(*ph.min);
  }
  p["exposed"]["plan_exchange"] = {{"median_s", Median(r.exchange_s)},
                                   {"median_pct_of_step", Share(r.exchange_s, r.step_s)},
                                   {"min_rank_median_s", Median(r.exchange_min_s)}};
  p["exposed"]["plan_domains_exchange"] = {
      {"median_s", Median(r.domains_exchange_s)},
      {"median_pct_of_step", Share(r.domains_exchange_s, r.step_s)}};
  p["exposed"]["plan_without_exchange"] = {{"median_s", Median(r.plan_local_s)},
                                           {"median_pct_of_step", Share(r.plan_local_s, r.step_s)}};
  p["exposed"]["expert_mean_over_ranks_median_s"] = Median(r.expert_mean_s);
  p["exposed"]["dense_allreduce"] = {{"median_s", Median(r.dense_s)},
                                     {"median_pct_of_step", Share(r.dense_s, r.step_s)}};
  p["exposed"]["expert_allreduce"] = {{"median_s", Median(r.expert_ar_s)},
                                      {"median_pct_of_step", Share(r.expert_ar_s, r.step_s)}};
  p["exposed"]["domain_stats"] = {{"median_s", Median(r.domain_stats_s)},
                                  {"median_pct_of_step", Share(r.domain_stats_s, r.step_s)}};
  p["domain_imbalance_before"] = r.domain_imbalance_before;
  p["domain_imbalance_after"] = r.domain_imbalance_after;
  p["worst_domain_imbalance_before"] = MaxOf(r.domain_imbalance_before);
  p["worst_domain_imbalance_after"] = MaxOf(r.domain_imbalance_after);
  p["exposed"]["solve_and_check_replayed_median_s"] = r.solve_s;
  const auto [overhead_s, overhead_pct] = BalancingOverhead(r);
  const auto [min_s, min_pct] = BalancingOverhead(r, Overhead::kMinRank);
  const auto [own_s, own_pct] = BalancingOverhead(r, Overhead::kNoExchange);
  p["exposed"]["plan_fanout_reduce"] = {{"median_s", overhead_s},
                                        {"median_pct_of_step", overhead_pct},
                                        {"min_rank_median_s", min_s},
                                        {"min_rank_median_pct_of_step", min_pct},
                                        {"without_exchange_median_s", own_s},
                                        {"without_exchange_median_pct_of_step", own_pct}};
  if (none != nullptr && &r != none) {
    const auto [over_s, over_pct] = OverheadOverNone(r, *none);
    p["exposed"]["plan_fanout_reduce"]["over_none_median_s"] = over_s;
    p["exposed"]["plan_fanout_reduce"]["over_none_median_pct_of_step"] = over_pct;
  }
  p["exposed"]["dominant_phase"] = DominantPhase(r);
  if (none != nullptr) p["median_step_over_none"] = Median(r.step_s) / Median(none->step_s);
  p["imbalance_before"] = r.imbalance_before;
  p["imbalance_after"] = r.imbalance_after;
  p["replicas_per_microbatch"] = r.replicas;
  p["rank_rows_before"] = r.rows_before;
  p["rank_rows_after"] = r.rows_after;
  p["rank_rows_max_over_mean_before"] = MaxOverMean(r.rows_before);
  p["rank_rows_max_over_mean_after"] = MaxOverMean(Domain0RowsAfter(r));
  p["layer_rank_rows_before"] = r.layer_rows_before;
  p["layer_rank_rows_after"] = r.layer_rows_after;
  p["fanout_bytes_per_step"] = r.fanout_bytes;
  p["reduce_bytes_per_step"] = r.reduce_bytes;
  p["fanouts_per_step"] = r.fanouts;
  p["fanouts_skipped_per_step"] = r.fanouts_skipped;
  p["measured_microbatches"] = r.measured_microbatches;
  p["replay_matches_expert_rows"] = r.replay_matches_rows;
  p["replay_imbalance_after_max_diff"] = r.replay_imbalance_diff;
  p["replay_note"] = r.replay_note;

  return p;
}

// 5. The JSON document.
void PrintJson(const Report& rep) {
  const rackrun::v1::ModelSpec& m = rep.spec.model();
  nlohmann::json j;
  j["spec"] = rep.o.spec;
  j["overrides"] = rep.overrides;
  j["ranks"] = rep.ranks;
  j["threads_per_rank"] = rep.threads;
  j["cores"] = rep.cores;
  j["oversubscribed"] = rep.oversubscribed;
  j["load_average_1min"] = {rep.load_start, rep.load_end};
  j["omp_wait_policy"] = std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "";
  j["model"] = {{"blocks", m.blocks()},
                {"width", m.width()},
                {"experts", m.moe().experts()},
                {"top_k", m.moe().top_k()},
                {"expert_hidden", m.moe().expert_hidden()},
                {"aux_loss_coef", m.moe().aux_loss_coef()},
                {"residual", m.residual()}};
  j["batch_size"] = rep.config.batch_size;
  j["seq_len"] = rep.config.seq_len;
  j["microbatches"] = rep.config.microbatches;
  j["slots"] = rep.spec.balancer().slots();
  j["eplb_window"] = rep.spec.balancer().eplb_window();
  j["eplb_interval"] = rep.spec.balancer().eplb_interval();
  j["warmup_steps"] = rep.o.warmup;
  j["measured_steps"] = rep.o.steps;
  j["wall_s"] = rep.wall;
  j["layouts"] = nlohmann::json::array();
  for (const Layout& l : rep.layouts) j["layouts"].push_back(l.Name());
  for (const PolicyResult& r : rep.results) j["policies"].push_back(PolicyJson(rep, r));
  std::printf("%s\n", j.dump().c_str());
}

// 6. The tables: the run, the machine and the model first.
void PrintHeader(const Report& rep) {
  const rackrun::v1::ModelSpec& m = rep.spec.model();
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  std::printf(
      "ep_train_bench: %s, %d ranks x %d thread%s on %u cores (%s), MPI shared memory, "
      "OMP_WAIT_POLICY=%s\n",
      rep.o.spec.c_str(), rep.ranks, rep.threads, rep.threads == 1 ? "" : "s", rep.cores,
      rep.oversubscribed ? "OVERSUBSCRIBED: ranks x threads > cores" : "not oversubscribed",
      wait_policy != nullptr ? wait_policy : "(unset)");
  std::printf(
      "model: %d blocks, C=%d, %d experts top-%d, F=%d, %s; aux_loss_coef=%g; global batch %d "
      "x seq %d x %d microbatch(es) = %.0f tokens/step; slots %d, eplb window %d interval %d\n",
      m.blocks(), m.width(), m.moe().experts(), m.moe().top_k(), m.moe().expert_hidden(),
      m.residual().c_str(), m.moe().aux_loss_coef(), rep.config.batch_size, rep.config.seq_len,
      rep.config.microbatches, rep.tokens_per_step, rep.spec.balancer().slots(),
      rep.spec.balancer().eplb_window(), rep.spec.balancer().eplb_interval());
  std::printf(
      "%d warmup + %d measured steps per policy, fresh trainer each, interleaved step by step, "
      "seed %llu; load average "
      "%.1f -> %.1f (shared machine: medians; compare rows of one run); wall %.0f s\n\n",
      rep.o.warmup, rep.o.steps, static_cast<unsigned long long>(rep.config.seed), rep.load_start,
      rep.load_end, rep.wall);
}

void PrintLayoutsTable(const Report& rep) {
  // The rep.layouts side by side (one row per layout and policy).
  std::printf(
      "D x G layouts (D domains of G ranks; ms and %% of step: median over steps of the max over "
      "ranks)\n");
  std::printf("%-6s %-8s %9s %8s %11s %9s %16s %16s %15s %10s %10s\n", "layout", "policy", "p50 ms",
              "p90 ms", "vs first", "balance%", "dense allreduce", "expert allreduce",
              "domain stats", "worst bef", "worst aft");
  for (const PolicyResult& r : rep.results) {
    const PolicyResult* first = rep.FirstLayoutOf(r);
    auto cell = [&](const std::vector<double>& v) {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%6.2f (%4.1f%%)", 1e3 * Median(v), Share(v, r.step_s));
      return std::string(buf);
    };
    char vs_first[32] = "-";
    if (first != nullptr && first != &r) {
      std::snprintf(vs_first, sizeof(vs_first), "%+.1f%%",
                    100 * (Median(r.step_s) / Median(first->step_s) - 1));
    }
    std::printf("%-6s %-8s %9.1f %8.1f %11s %8.1f%% %16s %16s %15s %10.3f %10.3f\n",
                r.layout.Name().c_str(), r.policy.c_str(), 1e3 * Median(r.step_s),
                1e3 * Percentile(r.step_s, 0.9), vs_first, BalancingOverhead(r).second,
                cell(r.dense_s).c_str(), cell(r.expert_ar_s).c_str(),
                cell(r.domain_stats_s).c_str(), MaxOf(r.domain_imbalance_before),
                MaxOf(r.domain_imbalance_after));
  }
  std::printf(
      "(vs first: median step over the first layout's (%s) with the same policy; balance%% = "
      "plan + fan-out + grad reduce, median share of the step; dense allreduce over all %d "
      "ranks; expert allreduce over the D ranks holding a shard (0 with D = 1); domain stats = "
      "the all-reduce of every domain's balancing figures (0 with D = 1); worst bef/aft = the "
      "worst domain's rank imbalance max/mean before/after balancing, mean over steps and "
      "layers. Below: domain 0's per-layer and per-rank figures)\n\n",
      rep.layouts.front().Name().c_str(), rep.ranks);
}

void PrintStepTimeTable(const Report& rep) {
  std::printf("Step time (max over ranks per step)\n");
  std::printf("%-12s %10s %9s %10s %11s %13s %9s %9s %10s %10s\n", "policy", "median ms", "p90 ms",
              "tokens/s", "final loss", "max rel diff", "replicas", "fanouts", "fanout MB",
              "reduce MB");
  for (const PolicyResult& r : rep.results) {
    const PolicyResult* none = rep.NoneOf(r);
    double reps = 0;
    for (const double x : r.replicas) reps += x;
    char diff[32] = "-";
    if (none != nullptr && &r != none) std::snprintf(diff, sizeof(diff), "%.2e", rep.RelDiff(r));
    std::printf("%-12s %10.1f %9.1f %10.0f %11.5f %13s %9.2f %4.1f/%-4.1f %10.2f %10.2f\n",
                rep.Label(r).c_str(), 1e3 * Median(r.step_s), 1e3 * Percentile(r.step_s, 0.9),
                rep.tokens_per_step / Median(r.step_s), r.losses.back(), diff,
                reps / std::max(rep.layers, 1), r.fanouts, r.fanouts_skipped, r.fanout_bytes / 1e6,
                r.reduce_bytes / 1e6);
  }
  std::printf(
      "(max rel diff: over all %d steps vs none; replicas: per layer and microbatch; fanouts: "
      "run/skipped per step, all ranks; MB: sent per step, all ranks)\n\n",
      rep.o.warmup + rep.o.steps);
}

void PrintExposedCostTable(const Report& rep) {
  std::printf("Exposed cost per step: ms (%% of step), median over steps of the max over ranks\n");
  std::printf("%-12s %15s %15s %11s %15s %15s %15s %15s %11s\n", "policy", "plan", "of it exchange",
              "solve us", "fan-out", "grad reduce", "all-to-all", "expert max", "expert avg");
  for (const PolicyResult& r : rep.results) {
    auto cell = [&](const std::vector<double>& v) {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%6.2f (%4.1f%%)", 1e3 * Median(v), Share(v, r.step_s));
      return std::string(buf);
    };
    std::printf("%-12s %15s %15s %11.3f %15s %15s %15s %15s %11.2f\n", rep.Label(r).c_str(),
                cell(r.plan_s).c_str(), cell(r.exchange_s).c_str(), 1e6 * r.solve_s,
                cell(r.fanout_s).c_str(), cell(r.reduce_s).c_str(), cell(r.dispatch_s).c_str(),
                cell(r.expert_s).c_str(), 1e3 * Median(r.expert_mean_s));
    std::printf("%-12s %15.2f %15.2f %11s %15.2f %15.2f %15.2f\n", "  min rk",
                1e3 * Median(r.plan_min_s), 1e3 * Median(r.exchange_min_s), "",
                1e3 * Median(r.fanout_min_s), 1e3 * Median(r.reduce_min_s),
                1e3 * Median(r.dispatch_min_s));
  }
  std::printf(
      "(plan = load allgather (carrying the previous plan's fingerprint) + solve + invariant "
      "check, so it includes waiting for the slowest rank; of it exchange = the load allgather "
      "alone (the collective and that wait); solve us = the same solves and checks replayed alone "
      "on "
      "rank 0 from the load trace; all-to-all = token dispatch and combine, forward and backward; "
      "expert avg = mean over ranks; min rk = the same phases' ms, median over steps of the min "
      "over "
      "ranks: the last rank to reach a collective waits least, so this approaches the phase's own "
      "cost)\n");
  for (const PolicyResult& r : rep.results) {
    const PolicyResult* none = rep.NoneOf(r);
    const auto [overhead_s, overhead_pct] = BalancingOverhead(r);
    const auto [min_s, min_pct] = BalancingOverhead(r, Overhead::kMinRank);
    const auto [own_s, own_pct] = BalancingOverhead(r, Overhead::kNoExchange);
    char vs_none[160] = "";
    if (none != nullptr && &r != none) {
      const auto [over_s, over_pct] = OverheadOverNone(r, *none);
      std::snprintf(vs_none, sizeof(vs_none),
                    "; over none's in the same steps %+.2f ms (%+.1f%%); median step / none's = "
                    "%.3f",
                    1e3 * over_s, over_pct, Median(r.step_s) / Median(none->step_s));
    }
    std::printf(
        "%-12s plan + fan-out + grad reduce = %.2f ms (%.1f%% of step; min rk %.2f ms, %.1f%%; "
        "without the load exchange %.2f ms, %.1f%%)%s; largest exposed phase: %s\n",
        rep.Label(r).c_str(), 1e3 * overhead_s, overhead_pct, 1e3 * min_s, min_pct, 1e3 * own_s,
        own_pct, vs_none, DominantPhase(r).c_str());
  }
  std::printf("\n");
}

void PrintRankLoadTables(const Report& rep) {
  std::printf(
      "Rank load max/mean per MoE layer, mean over measured microbatches (before = masters "
      "only, after = executed plan)\n");
  std::printf("%-6s", "layer");
  for (const PolicyResult& r : rep.results) {
    std::printf(" %15s %-7s", (rep.Label(r) + ":bef").c_str(), "after");
  }
  std::printf("\n");
  for (int l = 0; l < rep.layers; ++l) {
    std::printf("%-6d", l);
    for (const PolicyResult& r : rep.results) {
      std::printf(" %15.3f %-7.3f", r.imbalance_before[static_cast<size_t>(l)],
                  r.imbalance_after[static_cast<size_t>(l)]);
    }
    std::printf("\n");
  }
  std::printf(
      "\nExpert rows per rank per microbatch, summed over MoE layers (before = home-rank "
      "loads from the recorded loads, after = expert_rows)\n");
  std::printf("%-12s", "rank");
  for (const PolicyResult& r : rep.results) {
    std::printf(" %15s %-7s", (rep.Label(r) + ":bef").c_str(), "after");
  }
  std::printf("\n");
  for (int q = 0; q < rep.ranks; ++q) {
    std::printf("%-12d", q);
    for (const PolicyResult& r : rep.results) {
      const auto i = static_cast<size_t>(q);
      // Before: domain 0's rep.ranks only (its load trace); after: every rank.
      char before[32] = "-";
      if (i < r.rows_before.size()) std::snprintf(before, sizeof(before), "%.0f", r.rows_before[i]);
      std::printf(" %15s %-7.0f", before, i < r.rows_after.size() ? r.rows_after[i] : 0.0);
    }
    std::printf("\n");
  }
  std::printf("%-12s", "max/mean");
  for (const PolicyResult& r : rep.results) {
    // Over domain 0's rep.ranks, both columns alike.
    std::printf(" %15.3f %-7.3f", MaxOverMean(r.rows_before), MaxOverMean(Domain0RowsAfter(r)));
  }
}

void PrintReplayCheck(const Report& rep) {
  std::printf("\n\nReplay check (rank 0 re-solves every recorded load matrix):");
  for (const PolicyResult& r : rep.results) {
    std::printf(" %s %s", rep.Label(r).c_str(),
                !r.replay_note.empty() ? r.replay_note.c_str()
                : r.replay_matches_rows
                    ? (r.layout.d > 1 ? "plans reproduce expert_rows on domain 0's ranks"
                                      : "plans reproduce expert_rows on every rank")
                    : "MISMATCH with expert_rows");
    if (r.replay_note.empty()) {
      std::printf(" (imbalance_after diff %.1e);", r.replay_imbalance_diff);
    }
  }
  std::printf("\n");
}

}  // namespace

// In sections: 1. flags and the MPI world; 2. the layouts and the trace folder; 3. the runs,
// interleaved step by step; 4. (rank 0) the self-check and the figures every output shares;
// 5. JSON, or 6. the tables (layouts, step time, exposed cost, rank loads, replay check).
int main(int argc, char** argv) {
  // 1. Flags and the MPI world.
  Options o;
  rackrun::bench::BenchStartup bench(
      argc, argv,
      "Expert-parallel training with the balancer policies side by side in one run (this\n"
      "file's header says what is measured). Run it under mpirun -np R (R >= 2).\n",
      {.passive_openmp_wait = true});
  rackrun::flags::FlagSet& flags = bench.flags();
  flags.String("--spec", &o.spec, "FILE", "the job spec");
  flags.Int("--steps", &o.steps, "N", "measured optimizer steps").Range(1);
  flags.Int("--warmup", &o.warmup, "W", "unmeasured steps first").Range(0);
  flags.List("--policies", &o.policies, "LIST", "balancer policies, side by side");
  flags.List("--layouts", &o.layouts, "LIST",
             "D x G layouts side by side: all, or DxG,... (D * G = ranks, G divides the "
             "experts); default: the spec's parallelism.expert_parallel");
  flags.Strings("--set", &o.overrides, "FIELD=VALUE", "override a spec field (repeatable)");
  if (std::optional<int> exit = bench.Start()) return *exit;
  if (comm::LauncherWorldSize() < 2) {
    std::fprintf(stderr,
                 "ep_train_bench needs at least 2 ranks: mpirun --allow-run-as-root "
                 "--oversubscribe -np 4 %s\n",
                 argv[0]);
    return 2;
  }
  const comm::ChannelOptions channel_options = [] {
    absl::StatusOr<comm::ChannelOptions> c = comm::ChannelOptions::FromEnv();
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", std::string(c.status().message()).c_str());
      std::exit(2);
    }
    return *c;
  }();
  std::unique_ptr<comm::DataChannel> channel =
      OrDie(comm::CreateMpiChannel(channel_options), -1, "starting MPI");
  const int rank = channel->rank();
  const int ranks = channel->size();

  // 2. The layouts and the trace folder. The bench's defaults first, so the user's --set wins.
  std::vector<std::string> overrides = {"model.moe.aux_loss_coef=0", "resources.threads=1"};
  overrides.insert(overrides.end(), o.overrides.begin(), o.overrides.end());

  const std::optional<std::vector<Layout>> layouts = CheckedLayouts(o, overrides, rank, ranks);
  if (!layouts.has_value()) {
    channel.reset();
    return 2;
  }
  char dir[256] = {};
  MakeTraceFolder(*channel, rank, dir);

  // 3. The runs: a fresh trainer per layout and policy, all stepped in turn.
  const Runs runs = RunInterleaved(*channel, o, overrides, *layouts, dir);
  const std::vector<PolicyResult>& results = runs.results;
  const rackrun::v1::JobSpec& spec = runs.spec;
  if (rank == 0) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  OrDie(channel->Barrier(), rank, "final barrier");
  if (rank != 0) {
    channel.reset();
    return 0;
  }

  // 4. Rank 0 only. The replay is the bench's self-check: a trace that cannot be read or
  // plans that do not reproduce what the ranks executed fail the run (exit 1), after the
  // figures are printed.
  const bool self_check_ok = std::all_of(results.begin(), results.end(), [](const PolicyResult& r) {
    return r.replay_note.empty() && r.replay_matches_rows;
  });
  const rt::TrainConfig config = rt::TrainConfigFromSpec(spec);
  const int threads = config.threads;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const Report rep{.o = o,
                   .overrides = overrides,
                   .layouts = *layouts,
                   .results = results,
                   .spec = spec,
                   .config = config,
                   .ranks = ranks,
                   .threads = threads,
                   .cores = cores,
                   .oversubscribed = static_cast<unsigned>(ranks * std::max(threads, 1)) > cores,
                   .tokens_per_step = static_cast<double>(config.batch_size) * config.seq_len *
                                      config.microbatches,
                   .layers = spec.model().blocks(),
                   .many_layouts = layouts->size() > 1,
                   .load_start = runs.load_start,
                   .load_end = runs.load_end,
                   .wall = runs.wall};

  // 5. JSON.
  if (bench.json()) {
    PrintJson(rep);
    channel.reset();
    return self_check_ok ? 0 : 1;
  }

  // 6. The tables: the run, the layouts, step time, exposed cost, rank loads, replay check.
  PrintHeader(rep);
  PrintLayoutsTable(rep);
  PrintStepTimeTable(rep);
  PrintExposedCostTable(rep);
  PrintRankLoadTables(rep);
  PrintReplayCheck(rep);
  channel.reset();
  if (!self_check_ok) std::fprintf(stderr, "ep_train_bench: the replay check failed (above)\n");
  return self_check_ok ? 0 : 1;
}
