// MoE token dispatch and combine over a planner::Plan (docs/design.md section 4.7): each source
// rank sends each routed (token, choice) row to the expert instance (master or replica) that
// the plan's per-source split assigns, the experts run, and the results come back in the
// original (token, choice) order.
//
// Works on raw row-major float buffers; knows nothing of the runtime's tensors. Rows live on the
// host unless the caller passes a RowMover that keeps them elsewhere (a GPU: the rows are
// packed, exchanged and unpacked there, through a channel that takes device buffers:
// DataChannel::takes_device_buffers).
#ifndef RACKRUN_COMM_TOKEN_DISPATCH_H_
#define RACKRUN_COMM_TOKEN_DISPATCH_H_

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/data_channel.h"
#include "planner/plan.h"

namespace rackrun::comm {

// The router's decision for this rank's tokens: expert[t * top_k + j] is the logical
// expert of token t's j-th choice (routed row t * top_k + j, a "choice" below; never
// called a slot, which is a replica slot).
struct TokenRouting {
  int64_t num_tokens = 0;
  int top_k = 0;
  std::vector<int32_t> expert;

  // This rank's row of the load matrix: counts[e] = choices routed to expert e.
  // InvalidArgument if `expert` has the wrong size or an id outside [0, experts).
  absl::StatusOr<std::vector<int64_t>> Loads(int experts) const;
};

// Packs and unpacks a dispatch's rows where they live, and holds its exchange buffers there.
// The host's (memcpy, std::vector) is TokenDispatch's default; runtime/cuda/device_rows.h keeps
// them on a GPU. Every pointer below is in the mover's memory; the index lists are host memory.
class RowMover {
 public:
  virtual ~RowMover() = default;
  // dst row q = src row index[q] / divisor, for q < index.size(); rows of `width` floats.
  virtual absl::Status Gather(const float* src, std::span<const int64_t> index, int64_t divisor,
                              int64_t width, float* dst) = 0;
  // dst row index[q] = src row q, for q < index.size(); the index rows are distinct.
  virtual absl::Status Scatter(const float* src, std::span<const int64_t> index, int64_t width,
                               float* dst) = 0;
  // An exchange buffer of at least `floats` floats: which 0 = the packed send rows, 1 = the
  // received rows. Valid until the next call with the same `which`.
  virtual absl::StatusOr<float*> Buffer(int which, int64_t floats) = 0;
  // Between packing and the channel's AllToAllV: the packed rows are complete when it returns
  // (a device waits for its stream).
  virtual absl::Status BeforeExchange() { return absl::OkStatus(); }
};

// The fixed layout of one dispatch (one microbatch, one MoE layer, one rank). Built once
// from the plan and the routing; used for the forward dispatch/combine and again, with
// the same layout, for the backward pass.
//
// Assignment (deterministic, identical on every run): for each expert e, this rank's
// choices routed to e, in ascending choice order, go to e's instances in the plan's instance
// order: the first split_at(loads, rank, i0) choices to instance i0, the next
// split_at(loads, rank, i1) to i1, and so on.
//
// Buffers on the instance side ("expert rows") are grouped by local batch: one batch per
// instance on this rank, in plan instance order; within a batch, rows from source 0 first,
// then source 1, ...; within a source, in that source's choice order.
class TokenDispatch {
 public:
  struct LocalBatch {
    int instance = -1;  // index into plan.instances
    int expert = -1;    // logical expert
    bool master = false;
    int64_t rows = 0;    // tokens this instance processes (its quota)
    int64_t offset = 0;  // first row of the batch in the expert-row buffers
  };

  // `plan_loads` are the loads the plan was solved from (every rank's row: an unreplicated
  // expert's split is its loads, planner/plan.h). InvalidArgument naming the field if the
  // plan's shapes are inconsistent (planner::ValidateSplitShape) or the loads' do not match
  // it, `rank` is outside the plan, or this rank's routing does not match the plan's split
  // (the error names the rank, expert and both counts).
  static absl::StatusOr<TokenDispatch> Create(const planner::Plan& plan,
                                              const planner::LoadMatrix& plan_loads, int rank,
                                              const TokenRouting& routing);
  // The same layout for rows the caller has already grouped by expert, as the MoE layer
  // hands them to its executor: rows [offsets[e], offsets[e+1]) are routed to expert e, and
  // each row is its own token and choice (top_k 1). Equal to Create with that routing, but
  // nothing is regrouped: each instance takes one run of rows. InvalidArgument as Create,
  // or naming `offsets` when it does not have experts + 1 ascending entries from 0.
  static absl::StatusOr<TokenDispatch> CreateGrouped(const planner::Plan& plan,
                                                     const planner::LoadMatrix& plan_loads,
                                                     int rank, std::span<const int64_t> offsets);

  const std::vector<LocalBatch>& local_batches() const { return batches_; }
  // Rows this rank's instances process, summed over its batches.
  int64_t expert_rows() const { return expert_rows_; }
  // Rows on the source side: num_tokens * top_k.
  int64_t choice_rows() const { return static_cast<int64_t>(choice_instance_.size()); }
  // The plan instance each choice of this rank goes to.
  const std::vector<int>& choice_instance() const { return choice_instance_; }

  // Forward dispatch: choice s sends token row x[s / top_k] ([num_tokens x width]);
  // expert_in receives [expert_rows x width]. Collective over `channel` (one AllToAllV).
  // `rows`: where the buffers live (null: the host); the channel must take that memory.
  absl::Status DispatchTokens(DataChannel& channel, std::span<const float> x, int64_t width,
                              std::span<float> expert_in, RowMover* rows = nullptr) const;
  // Like DispatchTokens, but choice s sends its own row choices[s] ([choice_rows x width]), e.g.
  // the gradient of a choice's output in the backward pass.
  absl::Status DispatchChoices(DataChannel& channel, std::span<const float> choices, int64_t width,
                               std::span<float> expert_in, RowMover* rows = nullptr) const;
  // Returns expert rows to their sources: choice_out[s] ([choice_rows x width]) receives the
  // row that choice s's instance produced. Collective (one AllToAllV).
  absl::Status Combine(DataChannel& channel, std::span<const float> expert_out, int64_t width,
                       std::span<float> choice_out, RowMover* rows = nullptr) const;

 private:
  TokenDispatch() = default;
  // Both factories: this rank's choices grouped by expert are positions
  // [expert_first[e], expert_first[e+1]) of the grouped order; position k is choice
  // (*by_expert)[k], or k itself when by_expert is null.
  static absl::StatusOr<TokenDispatch> Build(const planner::Plan& plan,
                                             const planner::LoadMatrix& loads, int rank,
                                             int64_t num_tokens, int top_k,
                                             std::span<const int64_t> expert_first,
                                             const std::vector<int64_t>* by_expert);
  absl::Status Dispatch(DataChannel& channel, std::span<const float> rows, int64_t rows_per_source,
                        bool per_token, int64_t width, std::span<float> expert_in,
                        RowMover* mover) const;
  // Packs with `gather`, exchanges (send_rows rows to each rank, recv_rows from each),
  // unpacks with `scatter`: the one AllToAllV both directions run.
  absl::Status Exchange(DataChannel& channel, RowMover& mover, const float* src,
                        std::span<const int64_t> gather, int64_t divisor,
                        const std::vector<int64_t>& send_rows,
                        const std::vector<int64_t>& recv_rows, std::span<const int64_t> scatter,
                        int64_t width, float* dst) const;
  absl::Status CheckChannel(const DataChannel& channel, absl::string_view operation) const;

  int rank_ = -1;
  int ranks_ = 0;
  int top_k_ = 0;
  int64_t num_tokens_ = 0;
  std::vector<int> choice_instance_;
  std::vector<LocalBatch> batches_;
  int64_t expert_rows_ = 0;
  // Source side: send_choices_ lists choices in send order (by destination rank, then plan
  // instance, then choice); send_rows_[d] rows go to rank d.
  std::vector<int64_t> send_choices_;
  std::vector<int64_t> send_rows_;
  // Instance side: recv_rows_[s] rows arrive from source s; received row q (in arrival
  // order: by source, then local instance, then the source's choice order) is expert row
  // recv_to_expert_[q].
  std::vector<int64_t> recv_rows_;
  std::vector<int64_t> recv_to_expert_;
};

// Runs one expert batch: `in` has batch.rows x in_width floats, `out` must receive
// batch.rows x out_width floats.
using ExpertFn = std::function<absl::Status(const TokenDispatch::LocalBatch& batch, const float* in,
                                            int64_t in_width, float* out, int64_t out_width)>;

// Dispatch x ([num_tokens x in_width]), run `expert` on every local batch in batch order,
// combine into choice_out ([choice_rows x out_width]).
absl::Status DispatchAndCombine(DataChannel& channel, const TokenDispatch& dispatch,
                                std::span<const float> x, int64_t in_width, const ExpertFn& expert,
                                int64_t out_width, std::span<float> choice_out);

// y[t] = sum over j ascending of weights[t * top_k + j] * choice_out[t * top_k + j], the one
// fixed order (so the result does not depend on where each choice ran).
// InvalidArgument on size mismatch.
absl::Status WeightedCombine(std::span<const float> choice_out, std::span<const float> weights,
                             int64_t num_tokens, int top_k, int64_t width, std::span<float> y);

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_TOKEN_DISPATCH_H_
