#include "planner/cluster.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/random.h"
#include "base/string_view.h"

namespace rackrun::planner {

// ClusterModel's defaults, and where each comes from (all assumptions of a DeepSeek-V3-like
// model, not measurements):
//  - 58 MoE layers: DeepSeek-V3's config.json, num_hidden_layers 61 with
//    first_k_dense_replace 3.
//  - 653.9e9 routed expert parameters: 58 layers x 256 routed experts x 3 x 7168 x 2048
//    (config.json n_routed_experts, hidden_size, moe_intermediate_size) = 653.91e9.
//  - 17.1e9 dense parameters: the technical report's 671B total (main model, MTP module
//    excluded) minus the routed experts; the report's 37B activated = 17.1B + 8 of 256
//    experts' share (20.4B), which agrees.
//  - 4 microbatches per step: the report's batch of 15360 sequences x 4096 tokens on 2048
//    GPUs is 30.7k tokens per GPU per step, about 4 microbatches of 8192 tokens per GPU
//    (the generator's default tokens per rank).
//  - bf16 gradients on the wire (2 bytes per parameter): assumption.
//  - 400 Gb/s per GPU scale-out at 80% achieved, 5 us per message: one ConnectX-7-class
//    NIC per GPU, as in NVIDIA's GB200 NVL72 and DGX H200 systems (line rate from NVIDIA's
//    datasheets); the efficiency and latency are assumptions.

absl::StatusOr<AllReduceAlgorithm> ParseAllReduceAlgorithm(std::string_view name) {
  if (name == "ring") return AllReduceAlgorithm::kRing;
  if (name == "tree") return AllReduceAlgorithm::kTree;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown all-reduce algorithm '", base::AsAbsl(name), "'; use ring or tree"));
}

std::string_view AllReduceAlgorithmName(AllReduceAlgorithm algorithm) {
  return algorithm == AllReduceAlgorithm::kRing ? "ring" : "tree";
}

double RingReduceScatterSeconds(double bytes, int n, const Link& link) {
  if (n <= 1 || bytes <= 0) return 0;
  const double steps = n - 1;
  return steps / n * bytes / link.bytes_per_s + steps * link.latency_s;
}

double AllReduceSeconds(AllReduceAlgorithm algorithm, double bytes, int n, const Link& link) {
  if (n <= 1 || bytes <= 0) return 0;
  if (algorithm == AllReduceAlgorithm::kRing) return 2 * RingReduceScatterSeconds(bytes, n, link);
  int depth = 0;
  while ((int64_t{1} << depth) < n) ++depth;  // ceil(log2 n)
  return 2 * bytes / link.bytes_per_s + 2.0 * depth * link.latency_s;
}

absl::Status ClusterModel::Validate() const {
  auto bad = [](std::string_view field, std::string_view rule) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster model: ", base::AsAbsl(field), " ", base::AsAbsl(rule)));
  };
  if (domains < 1) return bad("domains", "must be at least 1");
  if (!(scaleout_gbps > 0)) return bad("scaleout_gbps", "must be positive");
  if (!(scaleout_efficiency > 0) || scaleout_efficiency > 1) {
    return bad("scaleout_efficiency", "must be in (0, 1]");
  }
  if (!(scaleout_latency_s >= 0)) return bad("scaleout_latency_s", "must be non-negative");
  if (!(dense_params >= 0)) return bad("dense_params", "must be non-negative");
  if (!(expert_params >= 0)) return bad("expert_params", "must be non-negative");
  if (moe_layers < 1) return bad("moe_layers", "must be at least 1");
  if (microbatches_per_step < 1) return bad("microbatches_per_step", "must be at least 1");
  if (gradient_bytes_per_param < 1) return bad("gradient_bytes_per_param", "must be at least 1");
  return absl::OkStatus();
}

GradientReduce GradientReduceTime(const ClusterModel& model, const HardwareModel& hw,
                                  int ep_ranks) {
  GradientReduce r;
  const double bytes_per_param = static_cast<double>(model.gradient_bytes_per_param);
  const double dense_bytes = model.dense_params * bytes_per_param;
  const double g = std::max(ep_ranks, 1);
  const Link scaleup{hw.a2a_bytes_per_s, hw.fanout.latency_s};
  r.dense_scaleup_s = 2 * RingReduceScatterSeconds(dense_bytes, ep_ranks, scaleup);
  r.dense_scaleout_s =
      AllReduceSeconds(model.allreduce, dense_bytes / g, model.domains, model.scaleout());
  r.expert_scaleout_s = AllReduceSeconds(model.allreduce, model.expert_params * bytes_per_param / g,
                                         model.domains, model.scaleout());
  r.total_s = r.dense_scaleup_s + r.dense_scaleout_s + r.expert_scaleout_s;
  return r;
}

double BackwardSeconds(const LayerTime& forward) {
  return forward.dispatch_s + forward.combine_s + 2 * forward.compute_s + forward.exposed_fanout_s;
}

StepTime StepOfDomain(const std::vector<MicrobatchLayers>& microbatches, const ClusterModel& model,
                      const HardwareModel& hw) {
  StepTime s;
  const double dense_per_token = 6.0 * model.dense_params / hw.gemm_flops_per_s;
  for (const MicrobatchLayers& mb : microbatches) {
    if (mb.layers.empty()) continue;
    // Each simulated layer stands for moe_layers / simulated layers of the model's.
    const double scale =
        static_cast<double>(model.moe_layers) / static_cast<double>(mb.layers.size());
    double forward = 0, backward = 0;
    for (const LayerTime& t : mb.layers) {
      forward += t.total_s;
      backward += BackwardSeconds(t);
      s.moe_compute_s += scale * 3 * t.compute_s;
      s.moe_a2a_s += scale * 2 * (t.dispatch_s + t.combine_s);
      s.balancing_s += scale * (2 * t.exposed_fanout_s + t.replacement_s);
    }
    const double dense = dense_per_token * static_cast<double>(mb.max_rank_tokens);
    s.moe_forward_s += scale * forward;
    s.moe_backward_s += scale * backward;
    s.dense_s += dense;
    s.last_backward_s = scale * backward + dense * 2.0 / 3.0;
  }
  s.compute_s = s.moe_forward_s + s.moe_backward_s + s.dense_s;
  s.total_s = s.compute_s;
  return s;
}

StepTime JobStep(const std::vector<StepTime>& domains, const GradientReduce& reduce,
                 const ClusterModel& model) {
  StepTime s;
  for (const StepTime& d : domains) {
    if (d.compute_s >= s.compute_s) s = d;
  }
  s.allreduce_s = reduce.total_s;
  if (reduce.total_s > 0) {
    s.exposed_allreduce_s = std::max(reduce.total_s - s.last_backward_s,
                                     reduce.total_s / static_cast<double>(model.moe_layers));
  }
  s.total_s = s.compute_s + s.exposed_allreduce_s;
  return s;
}

uint64_t DomainSeed(uint64_t seed, int domain) {
  if (domain == 0) return seed;
  return base::SplitMix64(seed ^ base::SplitMix64(static_cast<uint64_t>(domain)));
}

}  // namespace rackrun::planner
