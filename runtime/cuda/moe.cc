#include "runtime/cuda/moe.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/model_kernels.h"

namespace rackrun::runtime::cuda {
namespace {

std::atomic<ExpertGemmPath> default_path{ExpertGemmPath::kPerExpert};

}  // namespace

void SetDefaultExpertGemmPath(ExpertGemmPath path) { default_path.store(path); }
ExpertGemmPath DefaultExpertGemmPath() { return default_path.load(); }

GpuMoe::GpuMoe(Device* device, MatMul* matmul, const MoeLayerConfig& config,
               const std::string& name, MoeWeights weights,
               std::unique_ptr<planner::Planner> planner, HostCopies host, MoeScratch* scratch)
    : device_(device),
      matmul_(matmul),
      config_(config),
      name_(name),
      w_(weights),
      planner_(std::move(planner)),
      host_(std::move(host)),
      path_(DefaultExpertGemmPath()),
      inv_rms_(device, name + " inverse rms"),
      scores_(device, name + " router scores"),
      weights_(device, name + " gates"),
      h13_(device, name + " expert h13"),
      expert_out_(device, name + " expert outputs (expert parallel)"),
      selected_(device, name + " selected experts"),
      counts_d_(device, name + " expert counts"),
      global_counts_d_(device, name + " expert counts over the ranks"),
      offsets_d_(device, name + " expert offsets"),
      slot_row_(device, name + " slot rows"),
      slot_scratch_(device, name + " slot row chunks"),
      column_partial_(device, name + " score sum partials"),
      column_sums_(device, name + " score sums"),
      shared_h13_(device, name + " shared h13"),
      own_scratch_(scratch == nullptr ? std::make_unique<MoeScratch>(device, name) : nullptr),
      scratch_(scratch == nullptr ? own_scratch_.get() : scratch),
      xn_(scratch_->xn),
      rows_(scratch_->rows),
      act_(scratch_->act),
      dexpert_out_(scratch_->dexpert_out),
      dh13_(scratch_->dh13),
      dact_(scratch_->dact),
      ddispatched_(scratch_->ddispatched),
      dxn_(scratch_->dxn),
      dweights_(device, name + " gate gradients"),
      dscores_(device, name + " router logit gradients"),
      aux_grad_(device, name + " aux-loss gradient"),
      partial_(device, name + " norm gain partials") {
  counts_.assign(static_cast<size_t>(config.experts), 0);
  offsets_.assign(static_cast<size_t>(config.experts) + 1, 0);
}

MoeScratch::MoeScratch(Device* device, const std::string& name)
    : xn(device, name + " normed input"),
      rows(device, name + " dispatched rows / expert outputs"),
      act(device, name + " expert activations"),
      dexpert_out(device, name + " expert output gradients"),
      dh13(device, name + " expert h13 gradients"),
      dact(device, name + " expert activation gradients"),
      ddispatched(device, name + " dispatched row gradients"),
      dxn(device, name + " normed input gradient") {}

absl::StatusOr<std::unique_ptr<GpuMoe>> GpuMoe::Create(Device* device, MatMul* matmul,
                                                       const MoeLayerConfig& config,
                                                       const std::string& name, MoeWeights weights,
                                                       MoeScratch* scratch) {
  if (config.local_experts < 0 || config.local_experts > config.experts ||
      config.expert_first < 0 ||
      (config.local_experts > 0 && config.expert_first + config.local_experts > config.experts)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU MoE (", name, "): the shard [", config.expert_first, ", ",
                     config.expert_first + config.local_experts, ") is not within the layer's ",
                     config.experts, " experts"));
  }
  if (config.experts <= 0 || config.top_k <= 0 || config.top_k > config.experts ||
      config.width <= 0 || config.expert_hidden <= 0 ||
      (config.shared_expert && (config.shared_hidden <= 0 || weights.shared_w13 == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat("GPU MoE (", name, "): invalid configuration"));
  }
  // One GPU: the `none` policy's plan (every expert's tokens to its one instance).
  absl::StatusOr<std::unique_ptr<planner::Planner>> planner = planner::MakePlanner(
      "none", planner::Domain{1, config.experts, 0}, planner::PlannerOptions{});
  if (!planner.ok()) return planner.status();
  // The host ends of the counts' and score sums' copies, once per layer.
  absl::StatusOr<PinnedBuffer<int32_t>> counts =
      PinnedBuffer<int32_t>::Allocate(config.experts, name + " expert counts (host)");
  if (!counts.ok()) return counts.status();
  absl::StatusOr<PinnedBuffer<double>> sums =
      PinnedBuffer<double>::Allocate(config.experts, name + " score sums (host)");
  if (!sums.ok()) return sums.status();
  absl::StatusOr<Event> ready = Event::Create();
  if (!ready.ok()) return ready.status();
  return std::unique_ptr<GpuMoe>(
      new GpuMoe(device, matmul, config, name, weights, *std::move(planner),
                 HostCopies{*std::move(counts), *std::move(sums), *std::move(ready)}, scratch));
}

bool GpuMoe::sharded() const {
  return config_.local_experts != 0 && config_.local_experts != config_.experts;
}

ExpertShard GpuMoe::shard() const {
  return {.first = sharded() ? config_.expert_first : 0,
          .count = sharded() ? config_.local_experts : config_.experts,
          .width = config_.width,
          .hidden = config_.expert_hidden,
          .w13 = w_.w13,
          .w2 = w_.w2,
          .dw13 = w_.dw13,
          .dw2 = w_.dw2};
}

const std::vector<int64_t>& GpuMoe::global_counts() const {
  const std::vector<int64_t>* g = executor_ != nullptr ? executor_->global_counts() : nullptr;
  return g != nullptr ? *g : counts_;
}

absl::Status GpuMoe::Check(cudaError_t e, const char* what) const {
  return CudaCheck(e, absl::StrCat(name_, " (GPU MoE): ", what));
}

absl::Status GpuMoe::CopyCountsToHost(int64_t tokens) {
  const int ne = config_.experts;
  cudaStream_t st = device_->stream();
  if (config_.aux_loss_coef > 0) {
    // P_e of the aux loss: the router scores' column sums (in double), copied with the counts.
    for (absl::Status s :
         {column_partial_.Resize({std::max<int64_t>(1, kernels::ScoreColumnPartials(tokens, ne))}),
          column_sums_.Resize({ne})}) {
      if (!s.ok()) return s;
    }
    if (absl::Status s =
            Check(kernels::ScoreColumnSums(tokens, ne, scores_.data(), column_partial_.data(),
                                           column_sums_.data(), st),
                  "score sums");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Check(cudaMemcpyAsync(host_.score_sums.data(), column_sums_.data(),
                                               column_sums_.bytes(), cudaMemcpyDeviceToHost, st),
                               "score sums to the host");
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = Check(cudaMemcpyAsync(host_.counts.data(), counts_d_.data(),
                                             counts_d_.bytes(), cudaMemcpyDeviceToHost, st),
                             "counts to the host");
      !s.ok()) {
    return s;
  }
  return host_.ready.Record(st);
}

absl::Status GpuMoe::DispatchOnDevice(int64_t tokens) {
  const int c = config_.width, ne = config_.experts, k = config_.top_k;
  cudaStream_t st = device_->stream();
  if (absl::Status s =
          Check(kernels::ExpertOffsets(ne, counts_d_.data(), offsets_d_.data(), st), "offsets");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Check(kernels::SlotRows(tokens, ne, k, selected_.data(), offsets_d_.data(),
                                               slot_scratch_.data(), slot_row_.data(), st),
                             "slot rows");
      !s.ok()) {
    return s;
  }
  return Check(kernels::DispatchRows(tokens, k, c, slot_row_.data(), xn_.data(), rows_.data(), st),
               "dispatch");
}

absl::Status GpuMoe::CountsFromHost() {
  const int ne = config_.experts;
  // The layer's one host wait: the counts' copy (the work issued before it keeps running).
  if (absl::Status s = host_.ready.Synchronize(); !s.ok()) return s;
  offsets_[0] = 0;
  for (int e = 0; e < ne; ++e) {
    const size_t i = static_cast<size_t>(e);
    counts_[i] = host_.counts.data()[i];
    offsets_[i + 1] = offsets_[i] + counts_[i];
  }
  return absl::OkStatus();
}

absl::Status GpuMoe::PlanFromCounts() {
  const int ne = config_.experts;
  if (absl::Status s = CountsFromHost(); !s.ok()) return s;
  planner::LoadMatrix loads(1, ne);
  for (int e = 0; e < ne; ++e) loads.at(0, e) = counts_[static_cast<size_t>(e)];
  absl::StatusOr<planner::Plan> plan = planner_->Solve(loads, 0);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<std::vector<ExpertBatch>> batches = PlanBatches(*plan, loads, 0);
  if (!batches.ok()) return batches.status();
  batches_ = *std::move(batches);
  // The device dispatched in expert order (ExpertOffsets) before the plan existed: the
  // plan's batches must be that order (one instance per expert, as policy none on one rank).
  bool same = batches_.size() == static_cast<size_t>(ne);
  for (size_t e = 0; same && e < batches_.size(); ++e) {
    const ExpertBatch& b = batches_[e];
    same = b.expert == static_cast<int>(e) && b.offset == offsets_[e] && b.rows == counts_[e];
  }
  if (!same) {
    return absl::InternalError(absl::StrCat(
        name_,
        " (GPU MoE): the plan's batches are not the expert order the device dispatched "
        "in; a plan with replicas needs its permutation on the device (not built)"));
  }
  return absl::OkStatus();
}

void GpuMoe::AuxLossFromSums(int64_t tokens) {
  const int ne = config_.experts;
  // Aux loss: f_e from the counts, P_e the mean router score (summed in double).
  aux_loss_ = 0;
  if (config_.aux_loss_coef <= 0) return;
  // f_e over every rank's routed slots (expert parallelism), P_e over this rank's tokens.
  const std::vector<int64_t>& counts = global_counts();
  const double* p = host_.score_sums.data();
  int64_t total_slots = 0;
  for (int e = 0; e < ne; ++e) total_slots += counts[static_cast<size_t>(e)];
  slot_fraction_.resize(static_cast<size_t>(ne));
  double total = 0;
  for (int e = 0; e < ne; ++e) {
    const double fe = static_cast<double>(counts[static_cast<size_t>(e)]) /
                      static_cast<double>(std::max<int64_t>(total_slots, 1));
    slot_fraction_[static_cast<size_t>(e)] = fe;
    total += fe * p[e] / static_cast<double>(tokens);
  }
  aux_loss_ = config_.aux_loss_coef * ne * total;
}

absl::Status GpuMoe::Forward(const float* u, int64_t tokens, float* out) {
  u_ = u;
  tokens_ = tokens;
  const int c = config_.width, ne = config_.experts, k = config_.top_k;
  const int64_t slots = tokens * k;
  for (absl::Status s :
       {xn_.Resize({tokens, c}), inv_rms_.Resize({tokens}), scores_.Resize({tokens, ne}),
        weights_.Resize({tokens, k}), selected_.Resize({tokens, k}), counts_d_.Resize({ne}),
        offsets_d_.Resize({ne + 1}), slot_row_.Resize({tokens, k}),
        slot_scratch_.Resize({std::max<int64_t>(1, kernels::SlotRowsScratch(tokens, ne, k))}),
        rows_.Resize({std::max<int64_t>(slots, 1), c})}) {
    if (!s.ok()) return s;
  }
  if (absl::Status s = ReserveExpertRows(slots); !s.ok()) return s;
  cudaStream_t st = device_->stream();
  if (absl::Status s =
          NormThenLinear(*matmul_, clock_, tokens, c, ne, u, w_.norm, xn_.data(), inv_rms_.data(),
                         w_.router, scores_.data(), absl::StrCat(name_, " (GPU MoE)"));
      !s.ok()) {
    return s;
  }
  MarkPhase(clock_, Phase::kRouting);
  if (absl::Status s = Check(kernels::RouterForward(tokens, ne, k, scores_.data(), w_.bias,
                                                    selected_.data(), weights_.data(), st),
                             "router");
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          Check(kernels::ExpertCounts(slots, ne, selected_.data(), counts_d_.data(), st), "counts");
      !s.ok()) {
    return s;
  }
  // Issued before the host waits on the counts: their copy, the permutation, the shared
  // expert (out overwritten; the combine adds to it).
  if (absl::Status s = CopyCountsToHost(tokens); !s.ok()) return s;
  if (absl::Status s = DispatchOnDevice(tokens); !s.ok()) return s;
  if (config_.shared_expert) {
    MarkPhase(clock_, Phase::kGemm);
    if (absl::Status s = SharedForward(out); !s.ok()) return s;
    MarkPhase(clock_, Phase::kRouting);
  }
  if (executor_ != nullptr) {
    // Expert parallelism: the executor plans over every rank's loads and runs this rank's
    // instances (host-staged); the aux loss needs its global counts, known after it.
    if (absl::Status s = CountsFromHost(); !s.ok()) return s;
    MarkPhase(clock_, Phase::kGemm);
    if (absl::Status s = ExpertsForwardOnRanks(); !s.ok()) return s;
    AuxLossFromSums(tokens);
  } else {
    if (sharded()) {
      return absl::FailedPreconditionError(
          absl::StrCat(name_,
                       " (GPU MoE): this layer holds a shard of its experts; run it with "
                       "an expert-parallel group (ExpertParallelGroup::Create)"));
    }
    if (absl::Status s = PlanFromCounts(); !s.ok()) return s;
    AuxLossFromSums(tokens);
    MarkPhase(clock_, Phase::kGemm);
    if (absl::Status s = ExpertsForward(); !s.ok()) return s;
  }
  MarkPhase(clock_, Phase::kRouting);
  return Check(kernels::CombineRows(tokens, k, c, slot_row_.data(), weights_.data(),
                                    ExpertOutputs(), /*add=*/config_.shared_expert, out, st),
               "combine");
}

absl::Status GpuMoe::ExpertsForwardOnRanks() {
  return OnRanks(
      rows_, &expert_out_, [this] { return executor_->PrepareForward(offsets_); },
      [this](const float* rows, float* out) { return executor_->Forward(offsets_, rows, out); });
}

absl::Status GpuMoe::ExpertsBackwardOnRanks() {
  return OnRanks(
      dexpert_out_, &ddispatched_, [this] { return executor_->PrepareBackward(); },
      [this](const float* rows, float* out) { return executor_->Backward(offsets_, rows, out); });
}

absl::Status GpuMoe::OnRanks(const DeviceTensor<float>& from, DeviceTensor<float>* to,
                             absl::FunctionRef<absl::Status()> prepare,
                             absl::FunctionRef<absl::Status(const float*, float*)> run) {
  // Otherwise host-staged, in pinned memory: the rows (expert order, as the CPU layer hands its
  // executor) go down while the executor prepares the pass on the host (forward: the load
  // exchange, the plan and the weights' fan-out), then its all-to-alls and this rank's
  // instances run, and the outputs go back up in the stream's order. No wait for that upload:
  // the next writer of the pinned output is this layer's next pass, after its own wait on a
  // later point of the stream.
  if (executor_->device_rows()) {
    // The executor keeps the rows on the device (runtime/cuda/device_rows.h): its packing
    // queues behind the dispatch kernels, and the outputs arrive in `to` in the stream's
    // order. Preparing first costs nothing: no copy to overlap it with.
    if (absl::Status s = prepare(); !s.ok()) return s;
    return run(from.data(), to->data());
  }
  cudaStream_t st = device_->stream();
  if (host_rows_.size() < from.size() || host_out_.size() < to->size()) {
    // An old buffer may still be an upload's source: the stream finishes with it first.
    if (absl::Status s = device_->Synchronize(); !s.ok()) return s;
  }
  for (absl::Status s : {host_rows_.Reserve(from.size(), name_ + " expert rows (host staging)"),
                         host_out_.Reserve(to->size(), name_ + " expert outputs (host staging)")}) {
    if (!s.ok()) return s;
  }
  if (rows_ready_.get() == nullptr) {
    absl::StatusOr<Event> e = Event::Create();
    if (!e.ok()) return e.status();
    rows_ready_ = *std::move(e);
  }
  if (absl::Status s = Check(
          cudaMemcpyAsync(host_rows_.data(), from.data(), from.bytes(), cudaMemcpyDeviceToHost, st),
          "expert rows to the host");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = rows_ready_.Record(st); !s.ok()) return s;
  if (absl::Status s = prepare(); !s.ok()) return s;
  if (absl::Status s = rows_ready_.Synchronize(); !s.ok()) return s;
  if (absl::Status s = run(host_rows_.data(), host_out_.data()); !s.ok()) return s;
  return Check(
      cudaMemcpyAsync(to->data(), host_out_.data(), to->bytes(), cudaMemcpyHostToDevice, st),
      "expert outputs to the device");
}

absl::Status GpuMoe::ReserveExpertRows(int64_t slots) {
  const int64_t rows = std::max<int64_t>(slots, 1);
  if (executor_ != nullptr) return expert_out_.Resize({rows, config_.width});
  return h13_.Resize({rows, 2 * config_.expert_hidden});
}

absl::Status GpuMoe::ExpertsForward() {
  const int c = config_.width, f = config_.expert_hidden;
  if (absl::Status s =
          matmul_->ExpertsLinear(c, 2 * f, rows_.data(), w_.w13, h13_.data(), batches_, path_);
      !s.ok()) {
    return s;
  }
  return ExpertOutputsFromH13();
}

absl::Status GpuMoe::ExpertOutputsFromH13() {
  const int c = config_.width, f = config_.expert_hidden;
  const int64_t rows = tokens_ * config_.top_k;
  // The shared expert's activations may have had the buffer since ReserveExpertRows.
  if (absl::Status s = act_.Resize({std::max<int64_t>(rows, 1), f}); !s.ok()) return s;
  if (absl::Status s =
          Check(kernels::SwigluActivation(rows, f, h13_.data(), act_.data(), device_->stream()),
                "SwiGLU");
      !s.ok()) {
    return s;
  }
  // Over the dispatched rows, which the W13 GEMM has read.
  return matmul_->ExpertsLinear(f, c, act_.data(), w_.w2, rows_.data(), batches_, path_);
}

absl::Status GpuMoe::SharedForward(float* out) {
  const int c = config_.width, fs = config_.shared_hidden;
  const int t = static_cast<int>(tokens_);
  if (absl::Status s = shared_h13_.Resize({tokens_, 2 * fs}); !s.ok()) return s;
  if (absl::Status s =
          matmul_->Run({.m = t, .n = 2 * fs, .k = c, .lda = c, .ldb = 2 * fs, .ldc = 2 * fs}, 1.0f,
                       xn_.data(), w_.shared_w13, 0.0f, shared_h13_.data());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = SharedActivations(); !s.ok()) return s;
  return matmul_->Run({.m = t, .n = c, .k = fs, .lda = fs, .ldb = c, .ldc = c}, 1.0f, act_.data(),
                      w_.shared_w2, 0.0f, out);
}

absl::Status GpuMoe::SharedActivations() {
  // In the scratch's activations: the routed experts write theirs after the shared expert's
  // forward has read these, and the backward computes them again after the routed experts'.
  const int fs = config_.shared_hidden;
  if (absl::Status s = act_.Resize({tokens_, fs}); !s.ok()) return s;
  return Check(
      kernels::SwigluActivation(tokens_, fs, shared_h13_.data(), act_.data(), device_->stream()),
      "shared SwiGLU");
}

absl::Status GpuMoe::Backward(const float* dout, float grad_scale, float* du) {
  if (u_ == nullptr) return absl::FailedPreconditionError(name_ + ": Backward without a Forward");
  const int c = config_.width, ne = config_.experts, k = config_.top_k;
  const int f = config_.expert_hidden;
  const int64_t tokens = tokens_, slots = tokens * k;
  const int t = static_cast<int>(tokens);
  // dh13_ and dact_ serve the routed experts, then the shared one.
  const int64_t scratch_rows = std::max<int64_t>(config_.shared_expert ? tokens : 1, slots);
  const int scratch_hidden = config_.shared_expert ? std::max(f, config_.shared_hidden) : f;
  for (absl::Status s :
       {dexpert_out_.Resize({std::max<int64_t>(slots, 1), c}), dweights_.Resize({tokens, k}),
        dscores_.Resize({tokens, ne}), dh13_.Resize({scratch_rows, 2 * scratch_hidden}),
        dact_.Resize({scratch_rows, scratch_hidden}),
        ddispatched_.Resize({std::max<int64_t>(slots, 1), c}), dxn_.Resize({tokens, c}),
        partial_.Resize({kernels::RmsNormPartialFloats(tokens, c)})}) {
    if (!s.ok()) return s;
  }
  if (absl::Status s = RecomputeForBackward(); !s.ok()) return s;
  cudaStream_t st = device_->stream();
  MarkPhase(clock_, Phase::kRouting);
  // Expert-output gradients in dispatched order and the gate gradients.
  if (absl::Status s = Check(kernels::CombineRowsBackward(
                                 tokens, k, c, slot_row_.data(), weights_.data(), ExpertOutputs(),
                                 dout, dexpert_out_.data(), dweights_.data(), st),
                             "combine backward");
      !s.ok()) {
    return s;
  }
  const float* aux = nullptr;
  if (config_.aux_loss_coef > 0) {
    // d(coef * E * sum_e f_e P_e)/d s_te = coef * E * f_e / T, f_e from the Forward.
    std::vector<float> g(static_cast<size_t>(ne));
    for (int e = 0; e < ne; ++e) {
      g[static_cast<size_t>(e)] =
          static_cast<float>(grad_scale * config_.aux_loss_coef * ne *
                             slot_fraction_[static_cast<size_t>(e)] / static_cast<double>(tokens));
    }
    if (absl::Status s = aux_grad_.Resize({ne}); !s.ok()) return s;
    // Pageable: copied before CopyFrom returns.
    if (absl::Status s = aux_grad_.CopyFrom(g); !s.ok()) return s;
    aux = aux_grad_.data();
  }
  if (absl::Status s = Check(
          kernels::RouterBackward(tokens, ne, k, scores_.data(), selected_.data(), weights_.data(),
                                  dweights_.data(), aux, dscores_.data(), st),
          "router backward");
      !s.ok()) {
    return s;
  }
  MarkPhase(clock_, Phase::kGemm);
  if (absl::Status s = executor_ != nullptr ? ExpertsBackwardOnRanks() : ExpertsBackward();
      !s.ok()) {
    return s;
  }
  if (config_.shared_expert) {
    if (absl::Status s = SharedBackward(dout); !s.ok()) return s;
  }
  MarkPhase(clock_, Phase::kRouting);
  if (absl::Status s =
          Check(kernels::CombineRows(tokens, k, c, slot_row_.data(), nullptr, ddispatched_.data(),
                                     /*add=*/config_.shared_expert, dxn_.data(), st),
                "gather input gradients");
      !s.ok()) {
    return s;
  }
  MarkPhase(clock_, Phase::kGemm);
  // Router: dWr += xn^T dlogits; dxn += dlogits Wr^T.
  if (absl::Status s = matmul_->LinearBackward(t, c, ne, xn_.data(), dscores_.data(), w_.router,
                                               w_.drouter, dxn_.data(), /*accumulate_dx=*/true);
      !s.ok()) {
    return s;
  }
  MarkPhase(clock_, Phase::kOther);
  return Check(kernels::RmsNormBackward(tokens, c, u_, w_.norm, inv_rms_.data(), dxn_.data(), du,
                                        w_.dnorm, partial_.data(), st),
               "norm backward");
}

absl::Status GpuMoe::ExpertsBackward() {
  const int c = config_.width, f = config_.expert_hidden;
  // dW2 += act^T dy; dact = dy W2^T.
  if (absl::Status s = matmul_->ExpertsLinearBackward(f, c, act_.data(), dexpert_out_.data(), w_.w2,
                                                      w_.dw2, dact_.data(), batches_, path_);
      !s.ok()) {
    return s;
  }
  const int64_t rows = tokens_ * config_.top_k;
  if (absl::Status s = Check(kernels::SwigluActivationBackward(rows, f, h13_.data(), dact_.data(),
                                                               dh13_.data(), device_->stream()),
                             "SwiGLU backward");
      !s.ok()) {
    return s;
  }
  // The dispatched rows again, where the expert outputs were; dW13 += x^T dh13;
  // dx = dh13 W13^T.
  MarkPhase(clock_, Phase::kRouting);
  if (absl::Status s = Check(kernels::DispatchRows(tokens_, config_.top_k, c, slot_row_.data(),
                                                   xn_.data(), rows_.data(), device_->stream()),
                             "dispatch again");
      !s.ok()) {
    return s;
  }
  MarkPhase(clock_, Phase::kGemm);
  return matmul_->ExpertsLinearBackward(c, 2 * f, rows_.data(), dh13_.data(), w_.w13, w_.dw13,
                                        ddispatched_.data(), batches_, path_);
}

absl::Status GpuMoe::RecomputeForBackward() {
  const int c = config_.width;
  const int64_t slots = tokens_ * config_.top_k;
  // The same sizes as the forward's (a layer's own h13 keeps its numbers).
  for (absl::Status s : {xn_.Resize({tokens_, c}), rows_.Resize({std::max<int64_t>(slots, 1), c}),
                         ReserveExpertRows(slots)}) {
    if (!s.ok()) return s;
  }
  MarkPhase(clock_, Phase::kOther);
  if (absl::Status s = Check(kernels::RmsNormForward(tokens_, c, u_, w_.norm, xn_.data(),
                                                     inv_rms_.data(), device_->stream()),
                             "norm again");
      !s.ok()) {
    return s;
  }
  if (executor_ != nullptr) return absl::OkStatus();
  MarkPhase(clock_, Phase::kGemm);
  return ExpertOutputsFromH13();
}

absl::Status GpuMoe::SharedBackward(const float* dout) {
  const int c = config_.width, fs = config_.shared_hidden;
  const int t = static_cast<int>(tokens_);
  // The routed experts' backward is done with dh13_ / dact_ (sized for both) and act_:
  // reuse them.
  if (absl::Status s = SharedActivations(); !s.ok()) return s;
  if (absl::Status s = matmul_->LinearBackward(t, fs, c, act_.data(), dout, w_.shared_w2,
                                               w_.dshared_w2, dact_.data());
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          Check(kernels::SwigluActivationBackward(tokens_, fs, shared_h13_.data(), dact_.data(),
                                                  dh13_.data(), device_->stream()),
                "shared SwiGLU backward");
      !s.ok()) {
    return s;
  }
  return matmul_->LinearBackward(t, c, 2 * fs, xn_.data(), dh13_.data(), w_.shared_w13,
                                 w_.dshared_w13, dxn_.data());
}

absl::Status GpuMoe::UpdateSelectionBias() {
  if (config_.bias_update_rate <= 0) return absl::OkStatus();
  const int32_t* counts = counts_d_.data();
  if (executor_ != nullptr) {
    // Every rank steps its copy of the bias with the counts over all ranks, as the CPU layer.
    const std::vector<int64_t>& global = global_counts();
    std::vector<int32_t> narrow(global.size());
    for (size_t e = 0; e < global.size(); ++e) narrow[e] = static_cast<int32_t>(global[e]);
    if (absl::Status s = global_counts_d_.Resize({config_.experts}); !s.ok()) return s;
    if (absl::Status s = global_counts_d_.CopyFrom(narrow); !s.ok()) return s;
    counts = global_counts_d_.data();
  }
  return Check(kernels::SelectionBiasUpdate(config_.experts, counts, config_.bias_update_rate,
                                            w_.bias, device_->stream()),
               "selection bias");
}

}  // namespace rackrun::runtime::cuda
