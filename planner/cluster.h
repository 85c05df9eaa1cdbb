// The step-time model at cluster scale: D racks, each one expert-parallel (EP) domain of G
// GPUs on its scale-up network (NVLink), joined by a scale-out network, trained data
// parallel across racks. It composes the per-layer simulator (simulator.h) into a training
// step and adds the data-parallel gradient all-reduce.
//
// The layout (issue 24): domain d is ranks d*G .. d*G+G-1; experts are sharded inside every
// domain with the same layout and replicated across domains; each domain balances its own
// loads, so replicas, fan-out and token dispatch never leave it. Gradients:
//  - expert gradients (after the replica -> master reduction inside the domain) are
//    all-reduced over the D ranks that hold the same shard: every GPU all-reduces its
//    1/G of the routed expert parameters over the scale-out network, with its own link;
//  - dense gradients (replicated on every rank) are all-reduced over all D x G ranks,
//    hierarchically: a ring reduce-scatter inside the domain (scale-up), an all-reduce of
//    each GPU's 1/G shard over the D domains (scale-out), a ring all-gather inside the
//    domain. At D = 1 this is a plain ring all-reduce inside the rack.
//  The two scale-out all-reduces share each GPU's link and run one after the other; the
//  scale-up parts are added too (conservative: they could overlap the scale-out part).
//
// All-reduce of B bytes over n ranks, each with its own link of bandwidth bw (per
// direction) and per-message latency a (AllReduceSeconds):
//  - ring: reduce-scatter + all-gather, 2(n-1) steps of B/n each:
//        2 (n-1)/n B / bw + 2 (n-1) a
//  - tree: NCCL's double binary tree, reduce up and broadcast down, pipelined: every rank
//    moves 2 B per direction (interior in one tree, a leaf in the other), and a chunk
//    crosses the depth twice:
//        2 B / bw + 2 ceil(log2 n) a
//  n = 1 costs nothing. Ring is bandwidth-optimal (2 (n-1)/n < 2); tree wins on latency
//  once 2 (n-1) a - 2 ceil(log2 n) a exceeds the (2/n) B / bw it gives up.
//
// One step of one domain (StepOfDomain): M microbatches, each through L MoE layers and the
// dense part. The replay simulates `generated_layers` distinct MoE layers per microbatch;
// each stands for L / generated_layers of the model's layers (`moe_layers`).
//  - MoE forward: the simulator's layer time (dispatch, exposed fan-out, compute on the
//    busiest rank, combine, re-placement).
//  - MoE backward (BackwardOf): the same all-to-alls in reverse (gradients of the combine
//    and of the dispatch), twice the forward compute (input and weight gradients), and the
//    replica -> master gradient reduction, which moves the fan-out's bytes back along the
//    reversed schedule and is charged what the forward fan-out exposed. Re-placement is
//    not repeated.
//  - Dense forward + backward: 6 x dense_params FLOPs per token (2 forward, 4 backward) for
//    the source rank with most tokens, at the GEMM rate. Attention's sequence-length term
//    is not counted.
// The step of the job: the slowest domain's M microbatches (domains meet at the
// all-reduce), then the exposed part of the all-reduce.
//
// Overlap of the all-reduce with backward (the assumption, as Megatron's
// --overlap-grad-reduce and PyTorch DDP's buckets do it): gradients are accumulated over
// the M microbatches and reduced once, bucket by layer, starting as the LAST microbatch's
// backward produces them; the scale-out links are not used by the backward itself (EP
// traffic stays on the scale-up network). So the all-reduce hides behind that backward
// (B_last = its MoE backward + 2/3 of its dense time) up to its length, and the bucket of the
// layer that finishes last (1/L of it) is always exposed:
//     exposed = max(A - B_last, A / L)       (0 when A = 0)
// Earlier microbatches' backward does not hide it (their gradients are not final), and
// the optimizer step is not counted.
//
// The force-balanced ideal step is the same composition over the simulator's force-
// balanced ideal layers (no fan-out, no re-placement), with the same all-reduce.
#ifndef RACKRUN_PLANNER_CLUSTER_H_
#define RACKRUN_PLANNER_CLUSTER_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/simulator.h"

namespace rackrun::planner {

enum class AllReduceAlgorithm { kRing, kTree };

// "ring", "tree"; InvalidArgument listing them otherwise.
absl::StatusOr<AllReduceAlgorithm> ParseAllReduceAlgorithm(std::string_view name);
std::string_view AllReduceAlgorithmName(AllReduceAlgorithm algorithm);

// One GPU's link: achieved bandwidth per direction and latency per message (or step).
struct Link {
  double bytes_per_s = 0;
  double latency_s = 0;
};

// All-reduce of `bytes` over `n` ranks (formulas in the header comment); 0 for n <= 1 or
// no bytes.
double AllReduceSeconds(AllReduceAlgorithm algorithm, double bytes, int n, const Link& link);
// Ring reduce-scatter (or all-gather) of `bytes` over `n` ranks: (n-1)/n B / bw + (n-1) a.
double RingReduceScatterSeconds(double bytes, int n, const Link& link);

// The cluster and model inputs. Defaults: a DeepSeek-V3-like model (its published
// config.json and technical report; the sources are in cluster.cc), 400 Gb/s per GPU.
struct ClusterModel {
  int domains = 1;  // D: racks, each one EP domain
  AllReduceAlgorithm allreduce = AllReduceAlgorithm::kRing;
  double scaleout_gbps = 400;        // per GPU, per direction, line rate
  double scaleout_efficiency = 0.8;  // achieved fraction of it
  double scaleout_latency_s = 5e-6;  // per message
  // Parameters of the whole model: dense (attention, dense FFNs, shared experts,
  // embeddings) and routed experts (all MoE layers; each domain holds one copy, sharded).
  double dense_params = 17.1e9;
  double expert_params = 653.9e9;
  int moe_layers = 58;
  int microbatches_per_step = 4;
  int64_t gradient_bytes_per_param = 2;  // bf16 gradients on the wire

  Link scaleout() const {
    return Link{scaleout_gbps * 1e9 / 8 * scaleout_efficiency, scaleout_latency_s};
  }
  // InvalidArgument naming the field ("domains", "scaleout_gbps", ...).
  absl::Status Validate() const;
};

// The gradient all-reduce of one step, per GPU.
struct GradientReduce {
  double dense_scaleup_s = 0;    // ring reduce-scatter + all-gather of dense grads in the domain
  double dense_scaleout_s = 0;   // the 1/G dense shard over D domains
  double expert_scaleout_s = 0;  // the GPU's expert shard over D domains
  double total_s = 0;
};

// For domains of `ep_ranks` GPUs on `hw`'s scale-up network (a2a bandwidth, the fan-out's
// per-message latency).
GradientReduce GradientReduceTime(const ClusterModel& model, const HardwareModel& hw, int ep_ranks);

// A MoE layer's backward from its forward (header comment).
double BackwardSeconds(const LayerTime& forward);

// One microbatch of one domain: its simulated MoE layers (forward) and the tokens of its
// busiest source rank.
struct MicrobatchLayers {
  std::vector<LayerTime> layers;
  int64_t max_rank_tokens = 0;
};

// One domain's step, or the job's.
struct StepTime {
  double moe_forward_s = 0;    // forward MoE layers, all of them
  double moe_backward_s = 0;   // backward MoE layers
  double moe_compute_s = 0;    // their expert compute (forward + backward)
  double moe_a2a_s = 0;        // their dispatch and combine (forward + backward)
  double balancing_s = 0;      // exposed fan-out, replica-gradient reduction, re-placement
  double dense_s = 0;          // dense forward + backward
  double last_backward_s = 0;  // backward of the last microbatch (hides the all-reduce)
  double compute_s = 0;        // moe_forward + moe_backward + dense: M microbatches
  double allreduce_s = 0;      // the gradient all-reduce, all of it
  double exposed_allreduce_s = 0;
  double total_s = 0;  // compute + exposed all-reduce
};

// One domain's M microbatches (no all-reduce: allreduce and total are left at compute).
StepTime StepOfDomain(const std::vector<MicrobatchLayers>& microbatches, const ClusterModel& model,
                      const HardwareModel& hw);

// The job's step: the slowest domain's (by compute_s) figures plus the exposed all-reduce.
StepTime JobStep(const std::vector<StepTime>& domains, const GradientReduce& reduce,
                 const ClusterModel& model);

// The generator seed of domain d: `seed` for d = 0 (so one domain replays what `rackrun
// plan` generates without domains), a SplitMix64 mix of (seed, d) otherwise.
uint64_t DomainSeed(uint64_t seed, int domain);

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_CLUSTER_H_
