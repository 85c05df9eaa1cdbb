#include "comm/token_dispatch.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace rackrun::comm {
namespace {

absl::Status CheckPlanShape(const planner::Plan& plan, const planner::LoadMatrix& loads) {
  if (absl::Status s = planner::ValidateSplitShape(plan); !s.ok()) return s;
  if (loads.ranks != plan.ranks || loads.experts != plan.experts ||
      loads.counts.size() != static_cast<size_t>(plan.ranks) * static_cast<size_t>(plan.experts)) {
    return absl::InvalidArgumentError(
        absl::StrCat("token dispatch: loads are ", loads.ranks, " ranks x ", loads.experts,
                     " experts (", loads.counts.size(), " counts) but the plan is ", plan.ranks,
                     " x ", plan.experts, "; pass the loads the plan was solved from"));
  }
  for (int e = 0; e < plan.experts; ++e) {
    for (int i = plan.first[e]; i < plan.first[e + 1]; ++i) {
      const planner::ExpertInstance& inst = plan.instances[static_cast<size_t>(i)];
      if (inst.expert != e || inst.rank < 0 || inst.rank >= plan.ranks) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan.instances[", i, "] = (expert ", inst.expert, ", rank ", inst.rank,
                         ") but plan.first groups it under expert ", e, " in a domain of ",
                         plan.ranks, " ranks"));
      }
    }
  }
  return absl::OkStatus();
}

void CopyRow(const float* src, float* dst, int64_t width) {
  std::memcpy(dst, src, static_cast<size_t>(width) * sizeof(float));
}

// The host's rows.
class HostRowMover final : public RowMover {
 public:
  absl::Status Gather(const float* src, std::span<const int64_t> index, int64_t divisor,
                      int64_t width, float* dst) override {
    for (size_t q = 0; q < index.size(); ++q) {
      CopyRow(src + index[q] / divisor * width, dst + static_cast<int64_t>(q) * width, width);
    }
    return absl::OkStatus();
  }
  absl::Status Scatter(const float* src, std::span<const int64_t> index, int64_t width,
                       float* dst) override {
    for (size_t q = 0; q < index.size(); ++q) {
      CopyRow(src + static_cast<int64_t>(q) * width, dst + index[q] * width, width);
    }
    return absl::OkStatus();
  }
  absl::StatusOr<float*> Buffer(int which, int64_t floats) override {
    std::vector<float>& b = buffers_[which];
    if (b.size() < static_cast<size_t>(floats)) b.resize(static_cast<size_t>(floats));
    return b.data();
  }

 private:
  std::vector<float> buffers_[2];
};

std::vector<int64_t> Scaled(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * width;
  return out;
}

std::vector<int64_t> Displacements(const std::vector<int64_t>& counts) {
  std::vector<int64_t> displs(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) displs[i] = displs[i - 1] + counts[i - 1];
  return displs;
}

absl::Status CheckSpan(absl::string_view operation, absl::string_view name, size_t have,
                       int64_t rows, int64_t width) {
  if (have != static_cast<size_t>(rows * width)) {
    return absl::InvalidArgumentError(absl::StrCat(operation, ": ", name, " has ", have,
                                                   " floats; it needs ", rows, " rows x ", width,
                                                   " = ", rows * width));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> TokenRouting::Loads(int experts) const {
  if (num_tokens < 0 || top_k < 0 ||
      expert.size() != static_cast<size_t>(num_tokens) * static_cast<size_t>(top_k)) {
    return absl::InvalidArgumentError(
        absl::StrCat("routing.expert has ", expert.size(),
                     " entries; it needs num_tokens x top_k = ", num_tokens, " x ", top_k));
  }
  std::vector<int64_t> counts(static_cast<size_t>(experts), 0);
  for (size_t s = 0; s < expert.size(); ++s) {
    if (expert[s] < 0 || expert[s] >= experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("routing.expert[", s, "] = ", expert[s], " is outside [0, ", experts, ")"));
    }
    ++counts[static_cast<size_t>(expert[s])];
  }
  return counts;
}

absl::StatusOr<TokenDispatch> TokenDispatch::Create(const planner::Plan& plan,
                                                    const planner::LoadMatrix& plan_loads, int rank,
                                                    const TokenRouting& routing) {
  if (absl::Status s = CheckPlanShape(plan, plan_loads); !s.ok()) return s;
  absl::StatusOr<std::vector<int64_t>> loads = routing.Loads(plan.experts);
  if (!loads.ok()) return loads.status();
  // This rank's choices grouped by expert, in choice order within each (a counting sort).
  std::vector<int64_t> expert_first(static_cast<size_t>(plan.experts) + 1, 0);
  for (int e = 0; e < plan.experts; ++e) {
    expert_first[static_cast<size_t>(e) + 1] =
        expert_first[static_cast<size_t>(e)] + (*loads)[static_cast<size_t>(e)];
  }
  std::vector<int64_t> by_expert(routing.expert.size());
  std::vector<int64_t> next(expert_first.begin(), expert_first.end() - 1);
  for (size_t s = 0; s < routing.expert.size(); ++s) {
    by_expert[static_cast<size_t>(next[static_cast<size_t>(routing.expert[s])]++)] =
        static_cast<int64_t>(s);
  }
  return Build(plan, plan_loads, rank, routing.num_tokens, routing.top_k, expert_first, &by_expert);
}

absl::StatusOr<TokenDispatch> TokenDispatch::CreateGrouped(const planner::Plan& plan,
                                                           const planner::LoadMatrix& plan_loads,
                                                           int rank,
                                                           std::span<const int64_t> offsets) {
  if (absl::Status s = CheckPlanShape(plan, plan_loads); !s.ok()) return s;
  if (offsets.size() != static_cast<size_t>(plan.experts) + 1 || offsets.front() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("token dispatch: offsets has ", offsets.size(),
                     " entries; it needs experts + 1 = ", plan.experts + 1, " starting at 0"));
  }
  for (int e = 0; e < plan.experts; ++e) {
    if (offsets[static_cast<size_t>(e) + 1] < offsets[static_cast<size_t>(e)]) {
      return absl::InvalidArgumentError(
          absl::StrCat("token dispatch: offsets descend at expert ", e));
    }
  }
  return Build(plan, plan_loads, rank, offsets.back(), 1, offsets, nullptr);
}

absl::StatusOr<TokenDispatch> TokenDispatch::Build(const planner::Plan& plan,
                                                   const planner::LoadMatrix& loads, int rank,
                                                   int64_t num_tokens, int top_k,
                                                   std::span<const int64_t> expert_first,
                                                   const std::vector<int64_t>* by_expert) {
  if (rank < 0 || rank >= plan.ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token dispatch: rank ", rank, " is outside the plan's ", plan.ranks, " ranks"));
  }
  // The choice at position k of the grouped order (identity when already grouped).
  const auto choice_at = [&](int64_t k) {
    return by_expert == nullptr ? k : (*by_expert)[static_cast<size_t>(k)];
  };
  TokenDispatch d;
  d.rank_ = rank;
  d.ranks_ = plan.ranks;
  d.top_k_ = top_k;
  d.num_tokens_ = num_tokens;
  const int num_instances = plan.num_instances();

  // Each instance takes one run of its expert's choices, sized by the split:
  // [instance_first[i], instance_first[i] + split) in the grouped order.
  std::vector<int64_t> instance_first(static_cast<size_t>(num_instances), 0);
  d.choice_instance_.assign(static_cast<size_t>(num_tokens) * static_cast<size_t>(top_k), -1);
  for (int e = 0; e < plan.experts; ++e) {
    int64_t k = expert_first[static_cast<size_t>(e)];
    for (int i = plan.first[e]; i < plan.first[e + 1]; ++i) {
      const int64_t n = plan.split_at(loads, rank, i);
      if (n < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan.split(src ", rank, ", instance ", i, ") = ", n, " is negative"));
      }
      instance_first[static_cast<size_t>(i)] = k;
      k += n;
    }
    const int64_t routed =
        expert_first[static_cast<size_t>(e) + 1] - expert_first[static_cast<size_t>(e)];
    if (k - expert_first[static_cast<size_t>(e)] != routed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token dispatch on rank ", rank, ": routing sends ", routed, " tokens to expert ", e,
          " but the plan's split for this source assigns ",
          k - expert_first[static_cast<size_t>(e)], "; plan from this microbatch's exact loads"));
    }
    for (int i = plan.first[e]; i < plan.first[e + 1]; ++i) {
      const int64_t k0 = instance_first[static_cast<size_t>(i)];
      for (int64_t q = k0; q < k0 + plan.split_at(loads, rank, i); ++q) {
        d.choice_instance_[static_cast<size_t>(choice_at(q))] = i;
      }
    }
  }

  // Send order: destination rank, then instance, then choice.
  d.send_rows_.assign(static_cast<size_t>(plan.ranks), 0);
  d.send_choices_.reserve(d.choice_instance_.size());
  for (int dst = 0; dst < plan.ranks; ++dst) {
    for (int i = 0; i < num_instances; ++i) {
      if (plan.instances[static_cast<size_t>(i)].rank != dst) continue;
      const int64_t k0 = instance_first[static_cast<size_t>(i)];
      const int64_t n = plan.split_at(loads, rank, i);
      for (int64_t q = k0; q < k0 + n; ++q) d.send_choices_.push_back(choice_at(q));
      d.send_rows_[static_cast<size_t>(dst)] += n;
    }
  }

  // Local batches and where each arriving row lands.
  for (int i = 0; i < num_instances; ++i) {
    const planner::ExpertInstance& inst = plan.instances[static_cast<size_t>(i)];
    if (inst.rank != rank) continue;
    LocalBatch b{i, inst.expert, inst.master, 0, d.expert_rows_};
    for (int src = 0; src < plan.ranks; ++src) b.rows += plan.split_at(loads, src, i);
    d.expert_rows_ += b.rows;
    d.batches_.push_back(b);
  }
  d.recv_rows_.assign(static_cast<size_t>(plan.ranks), 0);
  std::vector<int64_t> filled(d.batches_.size(), 0);
  for (int src = 0; src < plan.ranks; ++src) {
    for (size_t b = 0; b < d.batches_.size(); ++b) {
      const int64_t n = plan.split_at(loads, src, d.batches_[b].instance);
      if (n < 0) {
        return absl::InvalidArgumentError(absl::StrCat("plan.split(src ", src, ", instance ",
                                                       d.batches_[b].instance, ") = ", n,
                                                       " is negative"));
      }
      for (int64_t k = 0; k < n; ++k) {
        d.recv_to_expert_.push_back(d.batches_[b].offset + filled[b]++);
      }
      d.recv_rows_[static_cast<size_t>(src)] += n;
    }
  }
  return d;
}

absl::Status TokenDispatch::CheckChannel(const DataChannel& channel,
                                         absl::string_view operation) const {
  if (channel.size() != ranks_ || channel.rank() != rank_) {
    return absl::InvalidArgumentError(
        absl::StrCat(operation, ": the dispatch was built for rank ", rank_, " of ", ranks_,
                     " but the channel is rank ", channel.rank(), " of ", channel.size()));
  }
  return absl::OkStatus();
}

absl::Status TokenDispatch::Exchange(DataChannel& channel, RowMover& mover, const float* src,
                                     std::span<const int64_t> gather, int64_t divisor,
                                     const std::vector<int64_t>& send_rows,
                                     const std::vector<int64_t>& recv_rows,
                                     std::span<const int64_t> scatter, int64_t width,
                                     float* dst) const {
  absl::StatusOr<float*> send = mover.Buffer(0, static_cast<int64_t>(gather.size()) * width);
  if (!send.ok()) return send.status();
  absl::StatusOr<float*> recv = mover.Buffer(1, static_cast<int64_t>(scatter.size()) * width);
  if (!recv.ok()) return recv.status();
  if (absl::Status s = mover.Gather(src, gather, divisor, width, *send); !s.ok()) return s;
  if (absl::Status s = mover.BeforeExchange(); !s.ok()) return s;
  const std::vector<int64_t> send_counts = Scaled(send_rows, width);
  const std::vector<int64_t> recv_counts = Scaled(recv_rows, width);
  if (absl::Status s =
          channel.AllToAllV(*send, send_counts, Displacements(send_counts), *recv, recv_counts,
                            Displacements(recv_counts), DataType::kFloat32);
      !s.ok()) {
    return s;
  }
  return mover.Scatter(*recv, scatter, width, dst);
}

absl::Status TokenDispatch::Dispatch(DataChannel& channel, std::span<const float> rows,
                                     int64_t rows_per_source, bool per_token, int64_t width,
                                     std::span<float> expert_in, RowMover* mover) const {
  const char* op = per_token ? "DispatchTokens" : "DispatchChoices";
  if (absl::Status s = CheckChannel(channel, op); !s.ok()) return s;
  if (width < 1) return absl::InvalidArgumentError(absl::StrCat(op, ": width must be positive"));
  if (absl::Status s =
          CheckSpan(op, per_token ? "x" : "choices", rows.size(), rows_per_source, width);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSpan(op, "expert_in", expert_in.size(), expert_rows_, width); !s.ok()) {
    return s;
  }
  HostRowMover host;
  return Exchange(channel, mover != nullptr ? *mover : host, rows.data(), send_choices_,
                  per_token ? top_k_ : 1, send_rows_, recv_rows_, recv_to_expert_, width,
                  expert_in.data());
}

absl::Status TokenDispatch::DispatchTokens(DataChannel& channel, std::span<const float> x,
                                           int64_t width, std::span<float> expert_in,
                                           RowMover* rows) const {
  return Dispatch(channel, x, num_tokens_, /*per_token=*/true, width, expert_in, rows);
}

absl::Status TokenDispatch::DispatchChoices(DataChannel& channel, std::span<const float> choices,
                                            int64_t width, std::span<float> expert_in,
                                            RowMover* rows) const {
  return Dispatch(channel, choices, choice_rows(), /*per_token=*/false, width, expert_in, rows);
}

absl::Status TokenDispatch::Combine(DataChannel& channel, std::span<const float> expert_out,
                                    int64_t width, std::span<float> choice_out,
                                    RowMover* rows) const {
  if (absl::Status s = CheckChannel(channel, "Combine"); !s.ok()) return s;
  if (width < 1) return absl::InvalidArgumentError("Combine: width must be positive");
  if (absl::Status s = CheckSpan("Combine", "expert_out", expert_out.size(), expert_rows_, width);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSpan("Combine", "choice_out", choice_out.size(), choice_rows(), width);
      !s.ok()) {
    return s;
  }
  // The reverse of Dispatch: rows go back in arrival order, land in send order.
  HostRowMover host;
  return Exchange(channel, rows != nullptr ? *rows : host, expert_out.data(), recv_to_expert_, 1,
                  recv_rows_, send_rows_, send_choices_, width, choice_out.data());
}

absl::Status DispatchAndCombine(DataChannel& channel, const TokenDispatch& dispatch,
                                std::span<const float> x, int64_t in_width, const ExpertFn& expert,
                                int64_t out_width, std::span<float> choice_out) {
  std::vector<float> expert_in(static_cast<size_t>(dispatch.expert_rows() * in_width));
  if (absl::Status s = dispatch.DispatchTokens(channel, x, in_width, expert_in); !s.ok()) {
    return s;
  }
  std::vector<float> expert_out(static_cast<size_t>(dispatch.expert_rows() * out_width));
  for (const TokenDispatch::LocalBatch& batch : dispatch.local_batches()) {
    if (batch.rows == 0) continue;
    if (absl::Status s = expert(batch, expert_in.data() + batch.offset * in_width, in_width,
                                expert_out.data() + batch.offset * out_width, out_width);
        !s.ok()) {
      return s;
    }
  }
  return dispatch.Combine(channel, expert_out, out_width, choice_out);
}

absl::Status WeightedCombine(std::span<const float> choice_out, std::span<const float> weights,
                             int64_t num_tokens, int top_k, int64_t width, std::span<float> y) {
  const int64_t choices = num_tokens * top_k;
  if (choice_out.size() != static_cast<size_t>(choices * width) ||
      weights.size() != static_cast<size_t>(choices) ||
      y.size() != static_cast<size_t>(num_tokens * width)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "WeightedCombine: choice_out has ", choice_out.size(), " floats, weights ", weights.size(),
        ", y ", y.size(), "; they need ", choices * width, ", ", choices, " and ",
        num_tokens * width, " for ", num_tokens, " tokens x top_k ", top_k, " x width ", width));
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* out = y.data() + t * width;
    std::fill(out, out + width, 0.0f);
    for (int j = 0; j < top_k; ++j) {
      const int64_t s = t * top_k + j;
      const float w = weights[static_cast<size_t>(s)];
      const float* row = choice_out.data() + s * width;
      for (int64_t c = 0; c < width; ++c) out[c] += w * row[c];
    }
  }
  return absl::OkStatus();
}

}  // namespace rackrun::comm
