#include "runtime/expert_parallel.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "comm/fanout_executor.h"
#include "comm/token_dispatch.h"
#include "planner/fanout.h"
#include "runtime/expert_instances.h"
#include "runtime/layers/moe.h"

namespace rackrun::runtime {
namespace {

// Point-to-point tags: fan-out uses [0, experts), replica gradients [kGradTag, kGradTag +
// experts). Both stay below comm::kMaxUserTag.
constexpr int kGradTag = comm::kMaxUserTag / 2;

}  // namespace

// The ExpertExecutor of one MoE layer on one rank (see expert_parallel.h).
class ExpertParallelExecutor final : public ExpertExecutor<float> {
 public:
  ExpertParallelExecutor(ExpertParallelGroup* group, int layer,
                         std::unique_ptr<ExpertInstances> experts)
      : g_(group),
        layer_(layer),
        experts_(std::move(experts)),
        relay_(std::make_unique<planner::FanoutScheduler>(group->options().planner.fanout)),
        mover_(experts_->device_rows() != nullptr && group->channel().takes_device_buffers()
                   ? experts_->device_rows()
                   : nullptr) {
    const int e = g_->domain().experts();
    local_loads_.assign(static_cast<size_t>(e), 0);
    loads_ = planner::LoadMatrix(g_->domain().ranks, e);
    totals_.assign(static_cast<size_t>(e), 0);
    fingerprints_.assign(static_cast<size_t>(g_->domain().ranks), 0);
    slot_of_expert_.assign(static_cast<size_t>(e), -1);
  }

  absl::Status Forward(std::span<const int64_t> offsets, const float* dispatched,
                       float* expert_out) override;
  absl::Status Backward(std::span<const int64_t> offsets, const float* dexpert_out,
                        float* ddispatched) override;
  // Forward's first half: refetch and replica gradients finished, the plan, the fan-out
  // posted. Backward's: the layers sharing the gradient buffer finished, the refetch posted,
  // the replica gradients zeroed.
  absl::Status PrepareForward(std::span<const int64_t> offsets) override;
  absl::Status PrepareBackward() override;
  const std::vector<int64_t>* global_counts() const override { return &totals_; }
  bool device_rows() const override { return mover_ != nullptr; }
  absl::Status WeightsChanged() { return experts_->WeightsChanged(); }

 private:
  absl::Status SolvePlan(std::span<const int64_t> offsets);
  void PlaceWeights();
  // The last dispatch's local batches as the instances' batches (masters by local index,
  // replicas by slot).
  void LayOutBatches();
  // The plan's balance figures into the group's statistics.
  void RecordBalance();
  // This layer's slot store as the instances take it: the executor's host store, or with device
  // weights the instances' own device buffers (its weights are SlotWeights', its gradients
  // this backward's SlotGradients buffer).
  ExpertInstances::Slots PassSlots() {
    return {slots().weights.data(), mover_ != nullptr ? device_grads_ : grad_buffer().data()};
  }
  // Posts this microbatch's replica gradients to their masters' ranks (after Backward);
  // FinishReplicaGradients waits for them and adds them to the masters' gradients.
  absl::Status PostReplicaGradients();

 public:
  absl::Status FinishReplicaGradients();
  // Posts the fan-out of this layer's replica weights into its slots (nothing when no
  // instance is away from home, or when the slots already hold them at this weight
  // version); FinishFanOut completes it. Collective in effect: every rank calls both, for
  // the same layer, in the same order. `refetch` counts it as a backward refetch.
  absl::Status StartFanOut(bool refetch);
  absl::Status FinishFanOut();
  // Lets the fan-out in flight move on (relays forward the chunks they have, and Open MPI
  // progresses only inside its calls) between two batches the masters compute, when on
  // the rank's own thread outside a parallel region. Its first error is kept for
  // FinishFanOut.
  void PollFanOut();
  bool fanout_in_flight() const { return in_flight_ != nullptr; }
  // A Forward has run (Backward has a layout to mirror).
  bool has_forward() const { return dispatch_.has_value(); }

 private:
  // Prefixes `s` with where it happened: rank, layer, microbatch, phase.
  absl::Status Where(const absl::Status& s, absl::string_view phase) const;
  int rank() const { return g_->channel().rank(); }
  int64_t floats() const { return experts_->expert_floats(); }
  ReplicaSlotStore& slots() { return g_->options().share_slots ? g_->shared_slots() : own_slots_; }
  float* slot_weights(int slot) { return slots().weights.data() + slot * floats(); }
  // Shared slots alternate two gradient buffers by layer parity; own slots use one.
  std::vector<float>& grad_buffer() {
    return slots().grads[g_->options().share_slots ? layer_ % 2 : 0];
  }
  float* slot_grads(int slot) { return PassSlots().grads + slot * floats(); }

  ExpertParallelGroup* g_;
  int layer_;
  std::unique_ptr<ExpertInstances> experts_;

  std::vector<int64_t> local_loads_;
  planner::LoadMatrix loads_;
  std::vector<int64_t> totals_;
  std::vector<uint64_t> fingerprints_;
  planner::Plan plan_;
  // Where weights must be: per expert, its home rank first, then every other rank the plan
  // runs it on (ascending). Shaped as a Plan so FanoutScheduler can schedule it.
  planner::Plan placement_;
  planner::FanoutSchedule schedule_;
  std::unique_ptr<planner::FanoutScheduler> relay_;
  std::vector<int> slot_of_expert_;  // this rank's slot holding expert e, or -1
  int slots_used_ = 0;
  ReplicaSlotStore own_slots_;                       // unless the group's slots are shared
  std::vector<float> staging_;                       // packed master weights to send
  std::unique_ptr<comm::FanoutInFlight> in_flight_;  // StartFanOut .. FinishFanOut
  absl::Status poll_error_;  // the first error of PollFanOut while in_flight_
  // Replica-gradient reduction in flight: requests, (expert, buffer index) received in
  // placement order, and the receive buffers.
  std::vector<std::unique_ptr<comm::Request>> pending_;
  std::vector<std::pair<int, int>> received_;
  std::vector<float> grad_staging_;
  float* grad_staging_at_ = nullptr;  // grad_staging_, or the instances' (device gradients)
  // Sizes the receive buffers for `count` gradients (grad_staging_at_).
  absl::Status SizeGradientStaging(int count);

  // A prepared pass not yet run: the rows PrepareForward planned for (-1: none), and
  // whether PrepareBackward ran.
  int64_t prepared_rows_ = -1;
  bool backward_prepared_ = false;

  std::optional<comm::TokenDispatch> dispatch_;
  std::vector<ExpertInstances::Batch> batches_;
  // The expert-row buffers the dispatch fills and the combine reads: on the host, or the
  // instances' (Rows) when the rows stay on the device (mover_ non-null).
  Tensor<float> in_, out_, dy_, dx_;
  comm::RowMover* mover_;
  // Device weights (with device rows): the slots' device store of the fan-out in flight, and
  // this backward's replica gradients (SlotGradients).
  float* device_slots_ = nullptr;
  float* device_grads_ = nullptr;
  // This pass's pair of expert-row buffers (forward: in, out; backward: dy, dx) for `rows` rows.
  absl::Status PassRows(bool forward, int64_t rows, float** a, float** b);
};

absl::Status ExpertParallelExecutor::Where(const absl::Status& s, absl::string_view phase) const {
  return absl::Status(
      s.code(), absl::StrCat("rank ", rank(), " of ", g_->domain().ranks, ", MoE layer ", layer_,
                             g_->training() ? ", microbatch " : ", evaluation microbatch ",
                             g_->microbatch(), ", ", phase, ": ", s.message()));
}

absl::Status ExpertParallelExecutor::SolvePlan(std::span<const int64_t> offsets) {
  comm::DataChannel& ch = g_->channel();
  const int ne = g_->domain().experts();
  for (int e = 0; e < ne; ++e) local_loads_[static_cast<size_t>(e)] = offsets[e + 1] - offsets[e];
  PlanSource::Request request;
  request.microbatch = g_->microbatch();
  request.layer = layer_;
  request.training = g_->training();
  request.local_loads = local_loads_;
  const std::optional<ExpertParallelGroup::SolvedPlan> previous = g_->previous_plan();
  if (previous.has_value()) request.previous_fingerprint = previous->fingerprint;
  if (absl::Status s = g_->plan_source().Solve(request, &loads_, &plan_); !s.ok()) {
    return Where(s, g_->plan_source().name());
  }
  ExpertParallelStats& st = g_->mutable_stats();
  st.plan_exchange_s += g_->plan_source().last_exchange_seconds();
  if (g_->plan_source().carries_fingerprints() && previous.has_value()) {
    const std::span<const uint64_t> carried = g_->plan_source().carried_fingerprints();
    for (size_t r = 1; r < carried.size(); ++r) {
      if (carried[r] != carried[0]) {
        return Where(
            absl::FailedPreconditionError(absl::StrCat(
                "ranks disagree on the plan of MoE layer ", previous->layer,
                previous->training ? ", microbatch " : ", evaluation microbatch ",
                previous->microbatch, " (found when this plan's loads were exchanged): rank ", r,
                " solved fingerprint ", absl::Hex(carried[r]), ", rank 0 solved ",
                absl::Hex(carried[0]), "; every rank must run the same binary and job spec")),
            "comparing plan fingerprints");
      }
    }
  }
  if (g_->options().check_invariants) {
    if (absl::Status s =
            planner::CheckPlanInvariants(g_->domain(), loads_, plan_, g_->invariants());
        !s.ok()) {
      return Where(absl::InternalError(absl::StrCat("the ", g_->options().policy,
                                                    " plan breaks an invariant: ", s.message())),
                   "checking the plan");
    }
  }
  uint64_t fingerprint = planner::PlanFingerprint(plan_);
  if (g_->FaultAt(FaultKind::kPlanHash, layer_)) fingerprint ^= 0x5a5a5a5a5a5a5a5aULL;
  if (g_->plan_source().carries_fingerprints()) {
    // Compared when the next plan's loads are exchanged: a disagreement is found one plan
    // later, without a collective of its own.
    g_->RecordPlan(fingerprint, layer_);
  } else {
    const double t0 = base::NowSeconds();
    const absl::Status gathered =
        ch.Allgather(&fingerprint, fingerprints_.data(), 1, comm::DataType::kInt64);
    st.plan_exchange_s += base::NowSeconds() - t0;  // an exchange too: it waits for the ranks
    if (!gathered.ok()) return Where(gathered, "comparing plan fingerprints");
    for (int r = 1; r < g_->domain().ranks; ++r) {
      if (fingerprints_[static_cast<size_t>(r)] != fingerprints_[0]) {
        return Where(
            absl::FailedPreconditionError(absl::StrCat(
                "ranks disagree on the plan: rank ", r, " solved fingerprint ",
                absl::Hex(fingerprints_[static_cast<size_t>(r)]), ", rank 0 solved ",
                absl::Hex(fingerprints_[0]), "; every rank must run the same binary and job spec")),
            "comparing plan fingerprints");
      }
    }
  }
  totals_ = loads_.ExpertTotals();
  if (comm::DataChannel* replicas = g_->options().replicas;
      replicas != nullptr && replicas->size() > 1) {
    // Every domain's totals, summed: the global microbatch's counts. An exchange too: it
    // waits for the ranks of the other domains.
    const double t0 = base::NowSeconds();
    const absl::Status summed =
        replicas->AllReduce(totals_.data(), totals_.data(), static_cast<int64_t>(totals_.size()),
                            comm::DataType::kInt64, comm::ReduceOp::kSum);
    const double seconds = base::NowSeconds() - t0;
    st.plan_exchange_s += seconds;
    st.plan_domains_exchange_s += seconds;
    if (!summed.ok()) return Where(summed, "summing expert loads over the domains");
  }
  return absl::OkStatus();
}

void ExpertParallelExecutor::PlaceWeights() {
  const planner::Domain& d = g_->domain();
  const int ne = d.experts();
  placement_.ranks = d.ranks;
  placement_.experts = ne;
  placement_.instances.clear();
  placement_.first.assign(static_cast<size_t>(ne) + 1, 0);
  std::vector<int32_t> ranks;
  for (int e = 0; e < ne; ++e) {
    const int home = d.home_rank(e);
    ranks.clear();
    for (int i = plan_.first[e]; i < plan_.first[e + 1]; ++i) {
      const int r = plan_.instances[static_cast<size_t>(i)].rank;
      if (r != home) ranks.push_back(r);
    }
    std::sort(ranks.begin(), ranks.end());
    placement_.first[static_cast<size_t>(e)] = static_cast<int32_t>(placement_.instances.size());
    placement_.instances.push_back({e, home, true});
    for (const int32_t r : ranks) placement_.instances.push_back({e, r, false});
  }
  placement_.first[static_cast<size_t>(ne)] = static_cast<int32_t>(placement_.instances.size());
  // Slots in expert order; the same placement always gives the same slots.
  std::fill(slot_of_expert_.begin(), slot_of_expert_.end(), -1);
  slots_used_ = 0;
  for (const planner::ExpertInstance& i : placement_.instances) {
    if (!i.master && i.rank == rank())
      slot_of_expert_[static_cast<size_t>(i.expert)] = slots_used_++;
  }
  // Growing keeps the contents; no transfer is in flight on the slots here: a layer's
  // Forward first completes its own previous replica-gradient sends, and the trainer
  // completes every layer's after each microbatch (with shared slots, each Backward also
  // completes those of the layers sharing its gradient buffer).
  // With device weights the store's weights are the instances' (SlotWeights).
  ReplicaSlotStore& store = slots();
  const size_t need = static_cast<size_t>(std::max(slots_used_, 1) * floats());
  if (mover_ == nullptr && store.weights.size() < need) store.weights.resize(need);
  if (grad_buffer().size() < need) grad_buffer().resize(need);
}

absl::Status ExpertParallelExecutor::StartFanOut(bool refetch) {
  ExpertParallelStats& st = g_->mutable_stats();
  // No instance away from home anywhere (every rank sees the same placement): nothing to
  // send, and the slots keep whatever they hold.
  if (static_cast<int>(placement_.instances.size()) == g_->domain().experts()) {
    return absl::OkStatus();
  }
  ReplicaSlotStore& store = slots();
  const bool current = store.layer == layer_ && store.version == g_->weights_version() &&
                       store.instances == placement_.instances && store.first == placement_.first;
  if (current) {
    ++st.fanouts_skipped;
    return absl::OkStatus();
  }
  // The plan carries the schedule the planner built for its instances (masters first,
  // replicas by ascending rank: the placement whenever masters stay at home); a plan that
  // moves a master (EPLB) is scheduled here from where the weights live.
  const planner::FanoutSchedule* schedule = &plan_.fanout;
  if (plan_.instances != placement_.instances || plan_.first != placement_.first) {
    relay_->Schedule(placement_, &schedule_);
    schedule = &schedule_;
  }
  const planner::Domain& d = g_->domain();
  const int64_t n = floats();
  // Pack this rank's masters that have destinations: w13 then w2, the slot layout.
  std::map<int, std::span<std::byte>> buffers;
  int origins = 0;
  for (int e = 0; e < d.experts(); ++e) {
    if (d.home_rank(e) == rank() && placement_.first[e + 1] - placement_.first[e] > 1) ++origins;
  }
  // The masters' packed weights and the slots: host buffers, or the instances' device memory
  // (device weights).
  float* staging = nullptr;
  if (mover_ != nullptr) {
    absl::StatusOr<float*> on_device = experts_->FanoutStaging(origins);
    if (!on_device.ok()) return Where(on_device.status(), "sizing the fan-out's staging");
    staging = *on_device;
    absl::StatusOr<float*> store_on_device = experts_->SlotWeights(slots_used_);
    if (!store_on_device.ok()) return Where(store_on_device.status(), "sizing the replica slots");
    device_slots_ = *store_on_device;
  } else {
    if (staging_.size() < static_cast<size_t>(origins * n)) {
      staging_.resize(static_cast<size_t>(origins * n));
    }
    staging = staging_.data();
  }
  int k = 0;
  for (int e = 0; e < d.experts(); ++e) {
    if (placement_.first[e + 1] - placement_.first[e] <= 1) continue;
    if (d.home_rank(e) == rank()) {
      float* p = staging + k++ * n;
      if (absl::Status s = experts_->ReadMaster(e - experts_->first(), p); !s.ok()) {
        return Where(s, "reading master weights to fan out");
      }
      buffers[e] = std::as_writable_bytes(std::span<float>(p, static_cast<size_t>(n)));
    } else if (const int slot = slot_of_expert_[static_cast<size_t>(e)]; slot >= 0) {
      float* p = mover_ != nullptr ? device_slots_ + slot * n : slot_weights(slot);
      buffers[e] = std::as_writable_bytes(std::span<float>(p, static_cast<size_t>(n)));
    }
  }
  comm::FanoutExecutorOptions options;
  options.chunk_bytes = g_->options().chunk_bytes;
  absl::StatusOr<std::unique_ptr<comm::FanoutInFlight>> run = comm::StartFanout(
      g_->channel(), *schedule, n * static_cast<int64_t>(sizeof(float)), buffers, options);
  if (!run.ok()) return Where(run.status(), "fanning out replica weights");
  in_flight_ = *std::move(run);
  store.layer = -1;  // being overwritten until FinishFanOut
  ++st.fanouts;
  if (refetch) ++st.refetches;
  return absl::OkStatus();
}

void ExpertParallelExecutor::PollFanOut() {
  if (in_flight_ == nullptr || !poll_error_.ok() || omp_in_parallel()) return;
  if (absl::StatusOr<bool> done = in_flight_->Poll(); !done.ok()) poll_error_ = done.status();
}

absl::Status ExpertParallelExecutor::FinishFanOut() {
  if (in_flight_ == nullptr) return absl::OkStatus();
  absl::StatusOr<comm::FanoutExecutorStats> run =
      poll_error_.ok() ? in_flight_->Finish() : poll_error_;
  poll_error_ = absl::OkStatus();
  in_flight_.reset();
  g_->RefetchDone(this);
  if (!run.ok()) return Where(run.status(), "fanning out replica weights");
  g_->mutable_stats().fanout_bytes += run->bytes_sent;
  ReplicaSlotStore& store = slots();
  store.layer = layer_;
  store.instances = placement_.instances;
  store.first = placement_.first;
  store.version = g_->weights_version();
  if (absl::Status s = experts_->SlotsArrived(
          mover_ != nullptr ? device_slots_ : store.weights.data(), slots_used_);
      !s.ok()) {
    return Where(s, "taking the replica weights");
  }
  return absl::OkStatus();
}

void ExpertParallelExecutor::RecordBalance() {
  ExpertParallelStats& st = g_->mutable_stats();
  const planner::Domain& d = g_->domain();
  ExpertParallelStats::Layer& ls = st.layers[static_cast<size_t>(layer_)];
  ++ls.microbatches;
  const std::vector<int64_t> home = planner::HomeRankLoads(d, loads_);
  const std::vector<int64_t> planned = plan_.RankLoads();
  ls.imbalance_before += planner::Imbalance(home);
  ls.imbalance_after += planner::Imbalance(planned);
  st.rank_tokens_before.resize(static_cast<size_t>(d.ranks), 0);
  st.rank_tokens_after.resize(static_cast<size_t>(d.ranks), 0);
  for (size_t r = 0; r < home.size() && r < st.rank_tokens_before.size(); ++r)
    st.rank_tokens_before[r] += home[r];
  for (size_t r = 0; r < planned.size() && r < st.rank_tokens_after.size(); ++r)
    st.rank_tokens_after[r] += planned[r];
  ls.replicas += plan_.num_replicas();
}

void ExpertParallelExecutor::LayOutBatches() {
  const auto& local = dispatch_->local_batches();
  batches_.resize(local.size());
  for (size_t i = 0; i < local.size(); ++i) {
    const comm::TokenDispatch::LocalBatch& b = local[i];
    const int slot = slot_of_expert_[static_cast<size_t>(b.expert)];
    batches_[i] = {.offset = b.offset,
                   .rows = b.rows,
                   .master = slot < 0 ? b.expert - experts_->first() : -1,
                   .slot = slot};
  }
}

absl::Status ExpertParallelExecutor::PrepareForward(std::span<const int64_t> offsets) {
  ExpertParallelStats& st = g_->mutable_stats();
  prepared_rows_ = -1;
  backward_prepared_ = false;  // a new forward: a backward prepared before it is void
  if (g_->FaultAt(FaultKind::kExit, layer_)) std::_Exit(3);
  if (g_->FaultAt(FaultKind::kStall, layer_)) {
    std::this_thread::sleep_for(
        absl::ToChronoSeconds(2 * g_->channel().timeout() + absl::Seconds(5)));
  }
  // A backward refetch still in flight (a layer's backward posted the next one's) ends
  // before this layer's fan-out may reuse the slots.
  double t0 = base::NowSeconds();
  if (absl::Status s = g_->FinishRefetch(); !s.ok()) return s;
  double t1 = base::NowSeconds();
  st.fanout_s += t1 - t0;
  // The previous microbatch's replica gradients reach their masters before this one's
  // compute: masters' gradients always add in the same order.
  if (absl::Status s = FinishReplicaGradients(); !s.ok()) return s;
  t0 = base::NowSeconds();
  if (absl::Status s = SolvePlan(offsets); !s.ok()) return s;
  RecordBalance();
  if (g_->training() && g_->trace() != nullptr) {
    planner::TraceEntry entry;
    entry.microbatch = g_->microbatch();
    entry.layer = layer_;
    entry.loads = loads_;
    if (absl::Status s = g_->trace()->Append(entry); !s.ok()) return Where(s, "recording loads");
  }
  t1 = base::NowSeconds();
  st.plan_s += t1 - t0;

  // The replica weights travel while the tokens are dispatched and the masters compute.
  PlaceWeights();
  if (absl::Status s = StartFanOut(/*refetch=*/false); !s.ok()) return s;
  st.fanout_s += base::NowSeconds() - t1;
  prepared_rows_ = offsets.back();
  return absl::OkStatus();
}

absl::Status ExpertParallelExecutor::PassRows(bool forward, int64_t rows, float** a, float** b) {
  using RowsOf = ExpertInstances::RowsOf;
  if (mover_ != nullptr) {
    absl::StatusOr<float*> first = experts_->Rows(forward ? RowsOf::kIn : RowsOf::kDy, rows);
    if (!first.ok()) return first.status();
    absl::StatusOr<float*> second = experts_->Rows(forward ? RowsOf::kOut : RowsOf::kDx, rows);
    if (!second.ok()) return second.status();
    *a = *first;
    *b = *second;
    return absl::OkStatus();
  }
  const int64_t alloc = std::max<int64_t>(rows, 1), c = experts_->width();
  Tensor<float>& x = forward ? in_ : dy_;
  Tensor<float>& y = forward ? out_ : dx_;
  x.Resize({alloc, c});
  y.Resize({alloc, c});
  *a = x.data();
  *b = y.data();
  return absl::OkStatus();
}

absl::Status ExpertParallelExecutor::Forward(std::span<const int64_t> offsets,
                                             const float* dispatched, float* expert_out) {
  ExpertParallelStats& st = g_->mutable_stats();
  if (prepared_rows_ < 0) {
    if (absl::Status s = PrepareForward(offsets); !s.ok()) return s;
  } else if (prepared_rows_ != offsets.back()) {
    return absl::FailedPreconditionError(
        absl::StrCat("expert-parallel Forward over ", offsets.back(),
                     " rows after PrepareForward over ", prepared_rows_));
  }
  prepared_rows_ = -1;
  double t0 = base::NowSeconds();

  // Rows of the dispatched buffer are this rank's "tokens", one expert each, already
  // grouped by expert by the MoE layer.
  const int64_t rows = offsets.back();
  absl::StatusOr<comm::TokenDispatch> dispatch =
      comm::TokenDispatch::CreateGrouped(plan_, loads_, rank(), offsets);
  if (!dispatch.ok()) return Where(dispatch.status(), "laying out the token dispatch");
  dispatch_.emplace(*std::move(dispatch));
  const int c = experts_->width();
  const int64_t er = dispatch_->expert_rows();
  float *in = nullptr, *out = nullptr;
  if (absl::Status s = PassRows(/*forward=*/true, er, &in, &out); !s.ok()) {
    return Where(s, "sizing the expert rows");
  }
  if (absl::Status s =
          dispatch_->DispatchTokens(g_->channel(), {dispatched, static_cast<size_t>(rows * c)}, c,
                                    {in, static_cast<size_t>(er * c)}, mover_);
      !s.ok()) {
    return Where(s, "dispatching tokens");
  }
  double t1 = base::NowSeconds();
  st.dispatch_s += t1 - t0;

  LayOutBatches();
  const auto poll = [this] { PollFanOut(); };
  if (absl::Status s = experts_->BeginForward(in, er); !s.ok()) {
    return Where(s, "running experts");
  }
  if (absl::Status s = experts_->Forward(batches_, /*masters=*/true, PassSlots(), out, poll);
      !s.ok()) {
    return Where(s, "running master experts");
  }
  t0 = base::NowSeconds();
  st.expert_s += t0 - t1;
  if (absl::Status s = FinishFanOut(); !s.ok()) return s;
  t1 = base::NowSeconds();
  st.fanout_s += t1 - t0;
  if (absl::Status s = experts_->Forward(batches_, /*masters=*/false, PassSlots(), out, [] {});
      !s.ok()) {
    return Where(s, "running replica experts");
  }
  st.expert_rows += er;
  t0 = base::NowSeconds();
  st.expert_s += t0 - t1;
  if (absl::Status s = dispatch_->Combine(g_->channel(), {out, static_cast<size_t>(er * c)}, c,
                                          {expert_out, static_cast<size_t>(rows * c)}, mover_);
      !s.ok()) {
    return Where(s, "combining expert outputs");
  }
  st.dispatch_s += base::NowSeconds() - t0;
  return absl::OkStatus();
}

absl::Status ExpertParallelExecutor::PrepareBackward() {
  ExpertParallelStats& st = g_->mutable_stats();
  backward_prepared_ = false;
  if (!dispatch_.has_value()) {
    return absl::FailedPreconditionError("expert-parallel Backward without a Forward");
  }
  if (g_->options().share_slots) {
    // The replica-gradient sends of the layers sharing this gradient buffer read it:
    // complete them. This layer's replica weights come back into the slots if a later
    // layer took them: the layer above posted that refetch when it was done with the slots
    // (it travelled during that layer's combine and the blocks between); otherwise it is
    // posted now and travels during the dispatch and the masters' compute.
    if (absl::Status s = g_->FinishLayers(layer_ % 2); !s.ok()) return s;
    const double r0 = base::NowSeconds();
    if (!fanout_in_flight()) {
      if (absl::Status s = g_->FinishRefetch(); !s.ok()) return s;
      if (absl::Status s = StartFanOut(/*refetch=*/true); !s.ok()) return s;
    }
    st.fanout_s += base::NowSeconds() - r0;
  }
  // Replica gradients of this microbatch start from zero.
  if (mover_ != nullptr) {
    absl::StatusOr<float*> grads =
        experts_->SlotGradients(g_->options().share_slots ? layer_ % 2 : 0, slots_used_);
    if (!grads.ok()) return Where(grads.status(), "sizing the replica gradients");
    device_grads_ = *grads;
  } else {
    std::fill(grad_buffer().begin(), grad_buffer().begin() + slots_used_ * floats(), 0.0f);
  }
  backward_prepared_ = true;
  return absl::OkStatus();
}

absl::Status ExpertParallelExecutor::Backward(std::span<const int64_t> offsets,
                                              const float* dexpert_out, float* ddispatched) {
  ExpertParallelStats& st = g_->mutable_stats();
  if (!backward_prepared_) {
    if (absl::Status s = PrepareBackward(); !s.ok()) return s;
  }
  backward_prepared_ = false;
  const int c = experts_->width();
  const int64_t rows = offsets.back();
  const int64_t er = dispatch_->expert_rows();
  float *dy = nullptr, *dx = nullptr;
  if (absl::Status s = PassRows(/*forward=*/false, er, &dy, &dx); !s.ok()) {
    return Where(s, "sizing the expert row gradients");
  }
  const bool shared = g_->options().share_slots;
  double t0 = base::NowSeconds();
  if (absl::Status s =
          dispatch_->DispatchChoices(g_->channel(), {dexpert_out, static_cast<size_t>(rows * c)}, c,
                                     {dy, static_cast<size_t>(er * c)}, mover_);
      !s.ok()) {
    return Where(s, "dispatching output gradients");
  }
  double t1 = base::NowSeconds();
  st.dispatch_s += t1 - t0;
  const auto poll = [this] { PollFanOut(); };
  if (absl::Status s = experts_->BeginBackward(dy, er); !s.ok()) {
    return Where(s, "running experts' backward");
  }
  if (absl::Status s = experts_->Backward(batches_, /*masters=*/true, PassSlots(), dx, poll);
      !s.ok()) {
    return Where(s, "running master experts' backward");
  }
  t0 = base::NowSeconds();
  st.expert_s += t0 - t1;
  if (absl::Status s = FinishFanOut(); !s.ok()) return s;
  t1 = base::NowSeconds();
  st.fanout_s += t1 - t0;
  if (absl::Status s = experts_->Backward(batches_, /*masters=*/false, PassSlots(), dx, [] {});
      !s.ok()) {
    return Where(s, "running replica experts' backward");
  }
  t0 = base::NowSeconds();
  st.expert_s += t0 - t1;
  if (shared) {
    // Done with the slots: the layer below's replica weights may travel into them while
    // this layer combines and the blocks between run their backward.
    if (absl::Status s = g_->StartRefetch(layer_ - 1); !s.ok()) return s;
    t1 = base::NowSeconds();
    st.fanout_s += t1 - t0;
    t0 = t1;
  }
  if (absl::Status s = dispatch_->Combine(g_->channel(), {dx, static_cast<size_t>(er * c)}, c,
                                          {ddispatched, static_cast<size_t>(rows * c)}, mover_);
      !s.ok()) {
    return Where(s, "combining input gradients");
  }
  t1 = base::NowSeconds();
  st.dispatch_s += t1 - t0;
  absl::Status s = PostReplicaGradients();
  st.reduce_s += base::NowSeconds() - t1;
  return s;
}

absl::Status ExpertParallelExecutor::PostReplicaGradients() {
  const planner::Domain& d = g_->domain();
  comm::DataChannel& ch = g_->channel();
  const int64_t n = floats();
  // Every replica placement (expert e on a rank other than its home) sends its gradient
  // home; the home receives them into staging in placement order.
  int incoming = 0;
  for (int e = 0; e < d.experts(); ++e) {
    if (d.home_rank(e) == rank()) incoming += placement_.first[e + 1] - placement_.first[e] - 1;
  }
  if (absl::Status s = SizeGradientStaging(incoming); !s.ok()) {
    return Where(s, "reducing replica gradients");
  }
  pending_.clear();
  received_.clear();
  // Tags differ per layer so that reductions of several layers can be in flight at once.
  const int tag_base =
      kGradTag + (layer_ * d.experts()) % (comm::kMaxUserTag - kGradTag - d.experts() + 1);
  int k = 0;
  // One group, both ends of every pair in the same (expert) order: what transports that
  // match messages in issue order (NCCL) need; a no-op for MPI.
  if (absl::Status g = ch.GroupStart(); !g.ok()) return Where(g, "reducing replica gradients");
  for (int e = 0; e < d.experts(); ++e) {
    const int home = d.home_rank(e);
    for (int i = placement_.first[e] + 1; i < placement_.first[e + 1]; ++i) {
      const int r = placement_.instances[static_cast<size_t>(i)].rank;
      absl::StatusOr<std::unique_ptr<comm::Request>> req;
      if (r == rank()) {
        req = ch.Isend(slot_grads(slot_of_expert_[static_cast<size_t>(e)]), n,
                       comm::DataType::kFloat32, home, tag_base + e);
        g_->mutable_stats().reduce_bytes += n * static_cast<int64_t>(sizeof(float));
      } else if (home == rank()) {
        req = ch.Irecv(grad_staging_at_ + k * n, n, comm::DataType::kFloat32, r, tag_base + e);
        received_.emplace_back(e, k++);
      } else {
        continue;
      }
      if (!req.ok()) return Where(req.status(), "reducing replica gradients");
      pending_.push_back(*std::move(req));
    }
  }
  if (absl::Status g = ch.GroupEnd(); !g.ok()) return Where(g, "reducing replica gradients");
  return absl::OkStatus();
}

absl::Status ExpertParallelExecutor::SizeGradientStaging(int count) {
  if (mover_ != nullptr) {
    absl::StatusOr<float*> on_device = experts_->GradientStaging(count);
    if (!on_device.ok()) return on_device.status();
    grad_staging_at_ = *on_device;
    return absl::OkStatus();
  }
  const size_t need = static_cast<size_t>(count * floats());
  if (grad_staging_.size() < need) grad_staging_.resize(need);
  grad_staging_at_ = grad_staging_.data();
  return absl::OkStatus();
}

absl::Status ExpertParallelExecutor::FinishReplicaGradients() {
  if (pending_.empty()) return absl::OkStatus();
  const double t0 = base::NowSeconds();
  comm::DataChannel& ch = g_->channel();
  absl::Status s =
      comm::WaitAll(pending_, absl::Now() + ch.timeout(), "replica gradient reduction");
  pending_.clear();
  if (!s.ok()) return Where(s, "reducing replica gradients");
  // Fixed order: the master's own gradient (already accumulated), then replicas by rank.
  const int64_t n = floats();
  for (const auto& [e, idx] : received_) {
    s = experts_->AddToMaster(e - experts_->first(), grad_staging_at_ + idx * n);
    if (!s.ok()) break;
  }
  received_.clear();
  if (!s.ok()) return Where(s, "adding replica gradients to their masters");
  g_->mutable_stats().reduce_s += base::NowSeconds() - t0;
  return absl::OkStatus();
}

// ------------------------------------------------------------ ExpertParallelGroup

absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> ExpertParallelGroup::Create(
    comm::DataChannel& channel, Model<float>& model, const ExpertParallelOptions& options) {
  const ModelConfig& mc = model.config();
  if (mc.expert_ranks != channel.size() || mc.expert_rank != channel.rank()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model holds the experts of rank ", mc.expert_rank, " of ", mc.expert_ranks,
        " but the data channel is rank ", channel.rank(), " of ", channel.size(),
        "; build the model with expert_rank/expert_ranks from the channel"));
  }
  std::vector<MoeLayer<float>*> layers;
  for (int b = 0; b < mc.blocks; ++b) layers.push_back(&model.moe(b));
  return Create(channel, layers, options);
}

absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> ExpertParallelGroup::Create(
    comm::DataChannel& channel, const std::vector<MoeLayer<float>*>& layers,
    const ExpertParallelOptions& options) {
  std::vector<Layer> general;
  for (MoeLayer<float>* layer : layers) {
    general.push_back({layer->config(), std::make_unique<HostExpertInstances>(&layer->experts()),
                       [layer](std::unique_ptr<ExpertExecutor<float>> executor) {
                         layer->SetExecutor(std::move(executor));
                       }});
  }
  return Create(channel, std::move(general), options);
}

absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> ExpertParallelGroup::Create(
    comm::DataChannel& channel, std::vector<Layer> layers, const ExpertParallelOptions& options) {
  if (layers.empty()) return absl::InvalidArgumentError("expert parallelism needs a MoE layer");
  const MoeLayerConfig& mc = layers[0].config;
  for (size_t i = 0; i < layers.size(); ++i) {
    const ExpertInstances& x = *layers[i].instances;
    const int per_rank = mc.experts / channel.size();
    if (mc.experts % channel.size() != 0 || x.count() != per_rank ||
        x.first() != channel.rank() * per_rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MoE layer ", i, " holds experts [", x.first(), ", ", x.first() + x.count(), ") of ",
          mc.experts, ", not rank ", channel.rank(), "'s shard of ", channel.size(),
          " ranks; build it with expert_first/local_experts from the channel"));
    }
  }
  if (mc.experts >= kGradTag) {
    return absl::InvalidArgumentError(absl::StrCat("model.moe.experts: ", mc.experts,
                                                   " experts exceed the ", kGradTag,
                                                   " point-to-point tags expert parallelism uses"));
  }
  if (options.slots < 0) return absl::InvalidArgumentError("balancer.slots: must be >= 0");
  std::unique_ptr<ExpertParallelGroup> g(new ExpertParallelGroup(channel, options));
  g->domain_ = {channel.size(), mc.experts / channel.size(), options.slots};
  if (absl::Status s = g->domain_.Validate(); !s.ok()) return s;
  planner::PlannerOptions po = options.planner;
  if (po.expert_bytes == 0) {
    po.expert_bytes = layers[0].instances->expert_floats() * static_cast<int64_t>(sizeof(float));
  }
  if (options.plan_source != nullptr) {
    g->plan_source_ = options.plan_source;
  } else {
    absl::StatusOr<std::unique_ptr<InBandPlanSource>> source =
        InBandPlanSource::Create(channel, g->domain_, options.policy, po);
    if (!source.ok()) return source.status();
    g->own_plan_source_ = *std::move(source);
    g->plan_source_ = g->own_plan_source_.get();
  }
  // A plan source other than in-band (the coordinator) may plan with a policy this
  // process does not know; its plans are then held to the default invariants.
  if (const planner::PolicyTraits* policy = planner::FindPolicy(options.policy);
      policy != nullptr) {
    g->invariants_ = policy->invariants();
  }
  if (!options.load_trace.empty() && channel.rank() == 0) {
    absl::StatusOr<planner::TraceWriter> w = planner::TraceWriter::Open(options.load_trace);
    if (!w.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("logging.load_trace: ", w.status().message()));
    }
    g->trace_.emplace(*std::move(w));
  }
  g->stats_.layers.resize(layers.size());
  for (size_t b = 0; b < layers.size(); ++b) {
    auto executor = std::make_unique<ExpertParallelExecutor>(g.get(), static_cast<int>(b),
                                                             std::move(layers[b].instances));
    g->executors_.push_back(executor.get());
    layers[b].install(std::move(executor));
  }
  return g;
}

ExpertParallelGroup::~ExpertParallelGroup() { (void)Close(); }

absl::Status ExpertParallelGroup::FinishMicrobatch() {
  if (absl::Status s = FinishRefetch(); !s.ok()) return s;
  for (ExpertParallelExecutor* e : executors_) {
    if (absl::Status s = e->FinishReplicaGradients(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ExpertParallelGroup::FinishLayers(int parity) {
  for (size_t layer = static_cast<size_t>(parity); layer < executors_.size(); layer += 2) {
    if (absl::Status s = executors_[layer]->FinishReplicaGradients(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ExpertParallelGroup::WeightsChanged() {
  ++weights_version_;
  for (ExpertParallelExecutor* e : executors_) {
    if (absl::Status s = e->WeightsChanged(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ExpertParallelGroup::StartRefetch(int layer) {
  if (layer < 0 || !options_.share_slots || refetching_ != nullptr) return absl::OkStatus();
  ExpertParallelExecutor* e = executors_[static_cast<size_t>(layer)];
  if (!e->has_forward()) return absl::OkStatus();
  if (absl::Status s = e->StartFanOut(/*refetch=*/true); !s.ok()) return s;
  if (e->fanout_in_flight()) refetching_ = e;
  return absl::OkStatus();
}

absl::Status ExpertParallelGroup::FinishRefetch() {
  if (refetching_ == nullptr) return absl::OkStatus();
  return refetching_->FinishFanOut();  // clears refetching_ (RefetchDone)
}

void ExpertParallelGroup::ResetStats() {
  const size_t layers = stats_.layers.size();
  stats_ = ExpertParallelStats();
  stats_.layers.resize(layers);
}

absl::Status ExpertParallelGroup::Close() {
  if (!trace_.has_value()) return absl::OkStatus();
  absl::Status s = trace_->Close();
  trace_.reset();
  return s;
}

bool ExpertParallelGroup::FaultAt(FaultKind kind, int layer) const {
  return faults_.has_value() && faults_->Due(kind, channel_.rank(), layer, microbatch_);
}

}  // namespace rackrun::runtime
