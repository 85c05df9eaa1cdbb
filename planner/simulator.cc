#include "planner/simulator.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/string_view.h"
#include "planner/baseline_planners.h"
#include "planner/planner.h"

namespace rackrun::planner {
namespace {

// The h200-nvl72 preset. Sources:
//  - hidden 7168, expert intermediate 2048, SwiGLU (3 matrices): DeepSeek-V3's published
//    config.json (hidden_size, moe_intermediate_size). One expert = 44.0 M parameters.
//  - bf16 weights and activations: our assumption (V3 itself runs expert GEMMs in FP8;
//    bf16 makes fan-out and dispatch bytes twice as large, the conservative side).
//  - 989 TFLOP/s dense BF16: NVIDIA H200 SXM datasheet (listed as 1,979 TFLOPS "with
//    sparsity"; dense is half). Achieved fraction 0.60 for grouped expert GEMMs of a few
//    thousand tokens: assumption.
//  - 900 GB/s per direction per GPU: NVLink 5 in GB200 NVL72 (NVIDIA: 1.8 TB/s per GPU
//    bidirectional, 130 TB/s over 72 GPUs). H200 itself ships with NVLink 4 in 8-GPU
//    boards; this preset is the hypothetical H200-class GPU in an NVL72-like rack that
//    rack-scale EP targets. Achieved all-to-all fraction 0.80: assumption (DeepEP
//    reports ~153 of 160 GB/s on H800 NVLink within 8 GPUs; 72-way traffic does worse).
//  - 10 us per all-to-all phase and 3 us per fan-out message: assumptions of the order of
//    DeepEP's low-latency kernels' fixed cost.
//  - 256 KiB fan-out chunks: docs/design.md section 3.9.
HardwareModel H200Nvl72() {
  HardwareModel hw;
  hw.name = "h200-nvl72";
  hw.hidden = 7168;
  hw.expert_intermediate = 2048;
  hw.matrices_per_expert = 3;
  hw.bytes_per_element = 2;
  hw.gemm_flops_per_s = 989e12 * 0.60;
  hw.a2a_bytes_per_s = 900e9 * 0.80;
  hw.a2a_latency_s = 10e-6;
  hw.fanout.egress_bytes_per_s = 900e9 * 0.80;
  hw.fanout.latency_s = 3e-6;
  hw.fanout.chunk_bytes = 256 << 10;
  return hw;
}

struct AllToAll {
  double seconds = 0;
  int64_t max_send_bytes = 0;
};

// One all-to-all phase from per-rank send/receive token counts.
AllToAll PhaseTime(const std::vector<int64_t>& send_tokens, const std::vector<int64_t>& recv_tokens,
                   const HardwareModel& hw) {
  AllToAll out;
  int64_t worst = 0;
  for (size_t r = 0; r < send_tokens.size(); ++r) {
    worst = std::max({worst, send_tokens[r], recv_tokens[r]});
    out.max_send_bytes = std::max(out.max_send_bytes, send_tokens[r] * hw.token_bytes());
  }
  if (worst > 0) {
    out.seconds =
        static_cast<double>(worst * hw.token_bytes()) / hw.a2a_bytes_per_s + hw.a2a_latency_s;
  }
  return out;
}

}  // namespace

absl::Status HardwareModel::Validate() const {
  auto bad = [this](std::string_view field) {
    return absl::InvalidArgumentError(
        absl::StrCat("hardware model '", name, "': ", base::AsAbsl(field), " must be positive"));
  };
  if (hidden <= 0) return bad("hidden");
  if (expert_intermediate <= 0) return bad("expert_intermediate");
  if (matrices_per_expert <= 0) return bad("matrices_per_expert");
  if (bytes_per_element <= 0) return bad("bytes_per_element");
  if (!(gemm_flops_per_s > 0)) return bad("gemm_flops_per_s");
  if (!(a2a_bytes_per_s > 0)) return bad("a2a_bytes_per_s");
  if (!(fanout.egress_bytes_per_s > 0)) return bad("fanout.egress_bytes_per_s");
  if (fanout.chunk_bytes <= 0) return bad("fanout.chunk_bytes");
  if (a2a_latency_s < 0 || fanout.latency_s < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hardware model '", name, "': latencies must be non-negative"));
  }
  return absl::OkStatus();
}

std::vector<std::string> HardwarePresetNames() { return {"h200-nvl72"}; }

absl::StatusOr<HardwareModel> HardwarePreset(std::string_view name) {
  if (name == "h200-nvl72") return H200Nvl72();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown hardware preset '", base::AsAbsl(name),
                   "'; known presets: ", absl::StrJoin(HardwarePresetNames(), ", ")));
}

LayerTime SimulateLayer(const Plan& plan, const LoadMatrix& loads, const HardwareModel& hw,
                        const FanoutCost& fanout, int64_t replacement_bytes) {
  const size_t g = static_cast<size_t>(plan.ranks);
  std::vector<int64_t> send(g, 0);
  std::vector<int64_t> recv(g, 0);
  const int n = plan.num_instances();
  for (int src = 0; src < plan.ranks; ++src) {
    for (int i = 0; i < n; ++i) {
      const int dst = plan.instances[static_cast<size_t>(i)].rank;
      if (dst == src) continue;
      const int64_t x = plan.split_at(loads, src, i);
      send[static_cast<size_t>(src)] += x;
      recv[static_cast<size_t>(dst)] += x;
    }
  }
  const AllToAll dispatch = PhaseTime(send, recv, hw);

  LayerTime t;
  t.dispatch_s = dispatch.seconds;
  t.combine_s = dispatch.seconds;  // the reverse phase: send and receive swap roles
  t.fanout_s = fanout.seconds;
  if (fanout.bytes > 0) {
    const double contention = static_cast<double>(dispatch.max_send_bytes + fanout.max_rank_bytes) /
                              std::min(hw.a2a_bytes_per_s, hw.fanout.egress_bytes_per_s);
    const double overlapped = std::max({t.dispatch_s, t.fanout_s, contention});
    t.exposed_fanout_s = overlapped - t.dispatch_s;
  }
  for (int64_t load : plan.RankLoads()) t.max_rank_tokens = std::max(t.max_rank_tokens, load);
  t.compute_s = static_cast<double>(t.max_rank_tokens) * hw.flops_per_token() / hw.gemm_flops_per_s;
  if (replacement_bytes > 0 && plan.ranks > 0) {
    t.replacement_s = static_cast<double>(replacement_bytes) /
                      (static_cast<double>(plan.ranks) * hw.fanout.egress_bytes_per_s);
  }
  t.total_s = t.dispatch_s + t.exposed_fanout_s + t.compute_s + t.combine_s + t.replacement_s;
  return t;
}

LayerTime SimulateForceBalanced(const LoadMatrix& loads, const HardwareModel& hw) {
  const LayerTime routed = SimulateBalancedRouting(loads, hw);
  if (loads.ranks <= 0 || loads.experts % loads.ranks != 0) return routed;
  IdealPlanner planner(Domain{loads.ranks, loads.experts / loads.ranks, 0}, PlannerOptions{});
  Plan plan;
  if (!planner.SolveInto(loads, 0, &plan).ok()) return routed;
  const LayerTime own = SimulateLayer(plan, loads, hw, FanoutCost{});
  return own.total_s < routed.total_s ? own : routed;
}

LayerTime SimulateBalancedRouting(const LoadMatrix& loads, const HardwareModel& hw) {
  const size_t g = static_cast<size_t>(loads.ranks);
  LayerTime t;
  if (g == 0) return t;
  std::vector<int64_t> sent(g, 0);
  int64_t total = 0;
  for (int src = 0; src < loads.ranks; ++src) {
    for (int e = 0; e < loads.experts; ++e) sent[static_cast<size_t>(src)] += loads.at(src, e);
    total += sent[static_cast<size_t>(src)];
  }
  // Source r keeps 1/G of its tokens and sends 1/G to each other rank, so it sends
  // A_r (G-1)/G and receives (total - A_r)/G.
  std::vector<int64_t> send(g);
  std::vector<int64_t> recv(g);
  const int64_t gi = static_cast<int64_t>(g);
  for (size_t r = 0; r < g; ++r) {
    send[r] = sent[r] * (gi - 1) / gi;
    recv[r] = (total - sent[r]) / gi;
  }
  const AllToAll dispatch = PhaseTime(send, recv, hw);
  t.dispatch_s = dispatch.seconds;
  t.combine_s = dispatch.seconds;
  t.max_rank_tokens = (total + gi - 1) / gi;
  t.compute_s = static_cast<double>(total) / static_cast<double>(gi) * hw.flops_per_token() /
                hw.gemm_flops_per_s;
  t.total_s = t.dispatch_s + t.compute_s + t.combine_s;
  return t;
}

double PercentOfIdeal(const LayerTime& ideal, const LayerTime& actual) {
  if (actual.total_s <= 0) return 100.0;
  return 100.0 * ideal.total_s / actual.total_s;
}

}  // namespace rackrun::planner
