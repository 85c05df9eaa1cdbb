#include "jobspec/job_memory.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/file.h"
#include "base/string_view.h"
#include "jobspec/device.h"
#include "jobspec/field_checks.h"

namespace rackrun::jobspec {
namespace {

constexpr int64_t kFloat = 4;  // the trainer's parameters, gradients and activations
// Code, shared libraries, OpenMP and gRPC thread stacks, allocator slack: the resident
// size of `rackrun train` on a tiny model (about 20 MiB peak on x86-64 Linux, GNU time).
constexpr int64_t kProcessOverhead = 24ll << 20;
constexpr char kTokenFields[] = "data.batch_size, model.seq_len";  // what sets `tokens`

// Saturating arithmetic: a product that overflows is "more than any machine has".
int64_t Mul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (a < 0 || b < 0) return 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::numeric_limits<int64_t>::max();
  return out;
}
int64_t Mul(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors) out = Mul(out, f);
  return out;
}
int64_t Add(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) return std::numeric_limits<int64_t>::max();
  return out;
}

// Trainable floats of the residual mappings (residual_streams.h lists the tensors; the
// xhc MLP write-back uses ResidualConfig's default convolutions 4, 8, 12: J = 3).
int64_t ResidualParameterCount(const rackrun::v1::ModelSpec& m) {
  const int64_t n = m.streams(), c = m.width(), k = m.active(), sublayers = Mul(2, m.blocks());
  const std::string& mode = m.residual();
  if (mode == "vanilla") return 0;
  if (mode == "hc") return Mul(sublayers, Add(Mul(n + 2, c), 2 + 2 * n + n * n));
  if (mode == "mhc") {
    return Mul(sublayers, Add(Mul({2 * n + n * n, n, c}), 3 + 2 * n + n * n));
  }
  const int64_t g = mode == "xhc_flash" ? 2 : mode == "xhc_flash4" ? 4 : 1;
  constexpr int64_t kConvTaps = 4 + 8 + 12, kConvs = 3;
  int64_t total = Mul({sublayers / g, n, n, c});  // routers
  for (int64_t l = 0; l < std::min<int64_t>(sublayers, 4); ++l) {
    // Sublayers repeat with period lcm(2, g) <= 4: count the first ones, scale the rest.
    const bool mlp = l % 2 == 1;
    const bool last = l % g == g - 1;
    const int64_t kr = mlp ? 1 + kConvs : 1;
    int64_t one = Add(Mul({n, n, c}), 1 + n);
    if (last) one = Add(one, Add(Mul({k, k, k, c}), 1 + k * k));
    one = Add(one, Add(Mul({k, kr, k, c}), 1 + k * kr));
    if (mlp) one = Add(one, Mul(kConvTaps, c));
    const int64_t repeats = (sublayers - l + 3) / 4;  // sublayers l, l+4, l+8, ...
    total = Add(total, Mul(one, repeats));
  }
  return total;
}

// Floats of the residual streams' state and saved rows for one microbatch of `tokens`.
int64_t ResidualActivationFloats(const rackrun::v1::ModelSpec& m, int64_t tokens) {
  const int64_t n = m.streams(), c = m.width(), k = std::max(1, m.active()),
                sublayers = Mul(2, m.blocks());
  const std::string& mode = m.residual();
  int64_t total = Mul({2, tokens, n, c});  // state X and its gradient
  if (mode == "vanilla") return total;
  if (mode == "hc" || mode == "mhc") {
    // Per sublayer: the saved input state, body output and coefficient records.
    return Add(total, Mul({sublayers, tokens, Add(Mul(n, c), c + 2 * (2 * n + n * n))}));
  }
  const int64_t g = mode == "xhc_flash" ? 2 : mode == "xhc_flash4" ? 4 : 1;
  constexpr int64_t kConvs = 3;
  // Per sublayer: saved rows (k + K_r) x C and coefficients; per token: group records,
  // the group's base reads and the backward workspaces.
  const int64_t kr_mean2 = 1 + (1 + kConvs);  // attention K_r = 1, MLP K_r = 4, per pair
  int64_t rows = Mul({m.blocks(), Add(Mul(2 * k, c), Mul(kr_mean2, c))});
  rows = Add(rows, Mul(sublayers, 1 + 3 * k * k + 2 * k * (1 + kConvs)));
  int64_t per_token = Add(rows, Mul(sublayers / g, k + 3 * n));
  per_token = Add(per_token, Add(Mul(g - 1, c), Mul(kConvs, c)));
  per_token = Add(per_token, k + g * n + n + g * n + 2 * k * k + k * (1 + kConvs));
  return Add(total, Mul(tokens, per_token));
}

// Adds `bytes` to one component of `e` and lists it as a term.
void Term(JobMemoryEstimate& e, int64_t& component, std::string what, std::string fields,
          int64_t bytes) {
  component = Add(component, bytes);
  e.terms.push_back({std::move(what), std::move(fields), bytes});
}

// Trainable parameters: value + gradient + AdamW m and v.
void Params(JobMemoryEstimate& e, std::string what, std::string fields, int64_t count) {
  e.parameter_count = Add(e.parameter_count, count);
  e.parameters = Add(e.parameters, Mul(count, kFloat));
  e.gradients = Add(e.gradients, Mul(count, kFloat));
  e.optimizer = Add(e.optimizer, Mul(count, 2 * kFloat));
  e.terms.push_back({absl::StrCat(what, " (weights, gradients, AdamW moments)"), std::move(fields),
                     Mul(count, 4 * kFloat)});
}

// The sizes the estimate multiplies (never negative; heads at least 1), for one rank.
struct Sizes {
  int64_t ranks, threads, vocab;
  int64_t c, blocks, heads, seq, experts, k, hidden, shared;
  int64_t local_experts;  // experts per rank of the expert-parallel domain
  int64_t global_rows;    // sequences per microbatch, all ranks
  int64_t rows;           // this rank's
  int64_t tokens;         // rows x seq
};

absl::StatusOr<Sizes> ReadSizes(const rackrun::v1::JobSpec& spec, const JobMemoryInputs& in) {
  const rackrun::v1::ModelSpec& m = spec.model();
  const rackrun::v1::MoeSpec& moe = m.moe();
  const int64_t ranks = std::max(1, in.ranks);
  const int64_t threads = std::max(1, in.threads);
  const int64_t vocab = m.vocab() > 0 ? m.vocab() : std::max<int64_t>(0, in.vocab);
  const int64_t c = std::max(0, m.width()), blocks = std::max(0, m.blocks()),
                heads = std::max(1, m.heads()), seq = std::max(0, m.seq_len()),
                experts = std::max(0, moe.experts()), k = std::max(0, moe.top_k()),
                hidden = std::max(0, moe.expert_hidden()),
                shared = moe.shared_expert() ? std::max(0, moe.shared_hidden()) : 0;
  // Experts are sharded over the G ranks of an expert-parallel domain, rows over all ranks.
  const int g = spec.parallelism().expert_parallel();
  const int64_t ep_ranks = g > 0 && g < ranks ? g : ranks;
  const int64_t local_experts = (experts + ep_ranks - 1) / ep_ranks;
  const int64_t global_rows = std::max(1, spec.data().batch_size());
  const int64_t rows = (global_rows + ranks - 1) / ranks;
  const int64_t tokens = Mul(rows, seq);
  if (Mul(global_rows, seq) > std::numeric_limits<int32_t>::max()) {
    return FieldError(
        "data.batch_size",
        absl::StrCat(global_rows, " sequences x model.seq_len ", seq, " = ", Mul(global_rows, seq),
                     " tokens per microbatch exceeds 2^31 - 1; lower "
                     "data.batch_size or model.seq_len (raise "
                     "training.microbatches to keep the step's tokens)"));
  }
  return Sizes{.ranks = ranks,
               .threads = threads,
               .vocab = vocab,
               .c = c,
               .blocks = blocks,
               .heads = heads,
               .seq = seq,
               .experts = experts,
               .k = k,
               .hidden = hidden,
               .shared = shared,
               .local_experts = local_experts,
               .global_rows = global_rows,
               .rows = rows,
               .tokens = tokens};
}

void AddParameterTerms(const rackrun::v1::ModelSpec& m, const Sizes& s, JobMemoryEstimate& e) {
  Params(e, "token embedding [vocab x width]", "model.vocab, model.width", Mul(s.vocab, s.c));
  Params(e, "LM head [width x vocab]", "model.vocab, model.width", Mul(s.c, s.vocab));
  Params(e, "attention weights [blocks x 4 width^2]", "model.width, model.blocks",
         Mul(s.blocks, Add(Mul(4 * s.c, s.c), s.c)));
  const int64_t expert_count = Mul({s.blocks, s.local_experts, 3, s.c, s.hidden});
  Params(e,
         s.ranks > 1 ? "expert weights [blocks x experts/ranks x 3 width x expert_hidden]"
                     : "expert weights [blocks x experts x 3 width x expert_hidden]",
         "model.moe.experts, model.moe.expert_hidden, model.width, model.blocks", expert_count);
  Params(e, "routers and norms", "model.moe.experts, model.width, model.blocks",
         Add(Mul(s.blocks, Add(Mul(s.c, s.experts), s.c)), s.c));
  if (s.shared > 0) {
    Params(e, "shared experts", "model.moe.shared_hidden, model.width, model.blocks",
           Mul({s.blocks, 3, s.c, s.shared}));
  }
  Params(e, "residual mappings", "model.streams, model.active, model.width, model.blocks",
         ResidualParameterCount(m));
  e.parameters = Add(e.parameters, Mul({s.blocks, s.experts, kFloat}));  // router_bias buffers
  if (s.ranks > 1) {
    // The packed dense gradients of the all-reduce.
    e.optimizer = Add(e.optimizer, Mul(Add(e.parameter_count, -expert_count), kFloat));
  }
}

// One microbatch of `tokens` on this rank.
void AddActivationTerms(const rackrun::v1::ModelSpec& m, const Sizes& s, JobMemoryEstimate& e) {
  const int64_t tc = Mul(s.tokens, s.c);
  const std::string tok_fields = kTokenFields;
  Term(e, e.activations, "LM-head logits [tokens x vocab]",
       absl::StrCat("model.vocab, ", tok_fields), Mul({s.tokens, s.vocab, kFloat}));
  Term(e, e.activations, "attention probabilities [blocks x rows x heads x seq^2]",
       absl::StrCat("model.seq_len, model.heads, data.batch_size, model.blocks"),
       Mul(Add(Mul({s.blocks, s.rows, s.heads, s.seq, s.seq}),
               Mul({s.blocks, s.threads, s.seq, s.seq})),
           kFloat));
  Term(e, e.activations,
       "sublayer inputs, outputs and attention state [blocks x 14 x tokens x width]",
       absl::StrCat("model.width, model.blocks, ", tok_fields),
       Mul(Add(Mul(14 * s.blocks + 8, tc),
               Mul(s.blocks, Add(Mul(s.seq, s.c / s.heads), 2 * s.tokens))),
           kFloat));
  const int64_t slots_rows = Mul(s.tokens, s.k);
  Term(e, e.activations, "MoE dispatch buffers [blocks x 4 x tokens x top_k x width]",
       absl::StrCat("model.moe.top_k, model.width, model.blocks, ", tok_fields),
       Mul({s.blocks, s.ranks > 1 ? 8 : 4, slots_rows, s.c, kFloat}));
  Term(e, e.activations, "expert hidden states [blocks x 6 x tokens x top_k x expert_hidden]",
       absl::StrCat("model.moe.expert_hidden, model.moe.top_k, model.blocks, ", tok_fields),
       Mul({s.blocks, 6, slots_rows, s.hidden, kFloat}));
  Term(e, e.activations, "router scores and gates [blocks x tokens x (2 experts + 4 top_k)]",
       absl::StrCat("model.moe.experts, model.moe.top_k, model.blocks, ", tok_fields),
       Mul({s.blocks, s.tokens, Add(2 * s.experts, 4 * s.k + 2 * s.c), kFloat}));
  if (s.shared > 0) {
    Term(e, e.activations, "shared-expert hidden states [blocks x 6 x tokens x shared_hidden]",
         absl::StrCat("model.moe.shared_hidden, model.blocks, ", tok_fields),
         Mul({s.blocks, s.tokens, Add(6 * s.shared, 2 * s.c), kFloat}));
  }
  Term(e, e.activations, "residual streams [tokens x streams x width] and saved rows",
       absl::StrCat("model.streams, model.width, model.blocks, ", tok_fields),
       Mul(ResidualActivationFloats(m, s.tokens), kFloat));
}

void AddBatchTerms(const rackrun::v1::JobSpec& spec, const JobMemoryInputs& in, const Sizes& s,
                   JobMemoryEstimate& e) {
  const std::string tok_fields = kTokenFields;
  // Token ids: the global batch the loader fills and this rank's rows (inputs, targets,
  // segment starts).
  Term(e, e.batch, "batch token ids", tok_fields,
       Mul({3, Add(Mul(s.global_rows, s.seq), s.ranks > 1 ? s.tokens : 0), 4}));
  if (s.ranks > 1 && spec.balancer().slots() > 0) {
    const int64_t slot = Mul({3, s.c, s.hidden});
    const int64_t floats = spec.balancer().shared_slots()
                               ? Mul({spec.balancer().slots(), slot, 3})
                               : Mul({s.blocks, spec.balancer().slots(), slot, 2});
    Term(e, e.expert_slots, "replica slots [slots x 3 width x expert_hidden]",
         "balancer.slots, model.moe.expert_hidden, model.width", Mul(floats, kFloat));
  }
  if (in.train_tokens > 0 || in.validation_tokens > 0) {
    Term(e, e.data, "token files (int32 in memory)", "data.train, data.validation",
         Add(Mul(in.train_tokens, 4), Mul(in.validation_tokens, 8)));
  }
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  if (bytes == std::numeric_limits<int64_t>::max()) return "more than 8 EiB (sizes overflow)";
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes) / 1024;
  int unit = 0;
  while (v >= 1024 && unit < 5) {
    v /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f %s", v, kUnits[unit]);
  return text;
}

std::string JobMemoryEstimate::Describe() const {
  std::string s = absl::StrCat(FormatBytes(total), ranks > 1 ? " per rank" : "", " (parameters ",
                               FormatBytes(parameters), ", gradients ", FormatBytes(gradients),
                               ", AdamW state ", FormatBytes(optimizer), ", activations ",
                               activations_on_gpu ? "on the GPU" : FormatBytes(activations),
                               ", batch ", FormatBytes(batch));
  if (expert_slots > 0) absl::StrAppend(&s, ", replica slots ", FormatBytes(expert_slots));
  if (data > 0) absl::StrAppend(&s, ", token files ", FormatBytes(data));
  absl::StrAppend(&s, ", process ", FormatBytes(overhead), ")");
  return s;
}

absl::StatusOr<JobMemoryEstimate> EstimateJobMemory(const rackrun::v1::JobSpec& spec,
                                                    const JobMemoryInputs& in) {
  absl::StatusOr<Sizes> sizes = ReadSizes(spec, in);
  if (!sizes.ok()) return sizes.status();
  JobMemoryEstimate e;
  e.ranks = static_cast<int>(sizes->ranks);
  AddParameterTerms(spec.model(), *sizes, e);
  // A cuda job's host model never runs a step (the GPU engine does; the host copy serves the
  // checkpoints), so its activations, allocated by the first forward, are never allocated
  // on the host; the GPU's are CheckDeviceMemory's question.
  absl::StatusOr<DeviceSpec> device = ParseDevice(spec.resources().device());
  e.activations_on_gpu = device.ok() && device->is_cuda();
  if (!e.activations_on_gpu) AddActivationTerms(spec.model(), *sizes, e);
  AddBatchTerms(spec, in, *sizes, e);
  e.overhead = kProcessOverhead;
  for (int64_t part : {e.parameters, e.gradients, e.optimizer, e.activations, e.batch,
                       e.expert_slots, e.data, e.overhead}) {
    e.total = Add(e.total, part);
  }
  std::stable_sort(e.terms.begin(), e.terms.end(),
                   [](const MemoryTerm& a, const MemoryTerm& b) { return a.bytes > b.bytes; });
  return e;
}

int64_t MachineMemory::usable() const {
  int64_t usable = available > 0 ? available : total;
  if (cgroup_limit > 0) {
    const int64_t room = std::max<int64_t>(0, cgroup_limit - cgroup_usage);
    usable = usable > 0 ? std::min(usable, room) : room;
  }
  return usable;
}

std::string MachineMemory::Describe() const {
  std::string s = absl::StrCat(FormatBytes(usable()), " usable (MemAvailable ",
                               FormatBytes(available), " of MemTotal ", FormatBytes(total));
  if (cgroup_limit > 0) {
    absl::StrAppend(&s, "; cgroup limit ", FormatBytes(cgroup_limit), ", ",
                    FormatBytes(cgroup_usage), " in use");
  }
  return s + ")";
}

MachineMemory ParseMachineMemory(std::string_view meminfo, std::string_view cgroup_limit,
                                 std::string_view cgroup_usage) {
  MachineMemory mm;
  for (absl::string_view line : absl::StrSplit(base::AsAbsl(meminfo), '\n')) {
    int64_t kib = 0;
    const auto value = [&](absl::string_view key) {
      if (!absl::ConsumePrefix(&line, key)) return false;
      line = absl::StripAsciiWhitespace(line);
      absl::ConsumeSuffix(&line, "kB");
      return absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib);
    };
    if (value("MemTotal:")) {
      mm.total = Mul(kib, 1024);
    } else if (value("MemAvailable:")) {
      mm.available = Mul(kib, 1024);
    }
  }
  int64_t bytes = 0;
  const absl::string_view limit = absl::StripAsciiWhitespace(base::AsAbsl(cgroup_limit));
  // cgroup v1 reports "no limit" as a huge page-rounded number: ignore limits above RAM.
  if (absl::SimpleAtoi(limit, &bytes) && bytes > 0 && (mm.total == 0 || bytes < mm.total)) {
    mm.cgroup_limit = bytes;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(base::AsAbsl(cgroup_usage)), &bytes)) {
      mm.cgroup_usage = bytes;
    }
  }
  return mm;
}

MachineMemory ReadMachineMemory() {
  const auto read = [](const std::string& path) {
    absl::StatusOr<std::string> text = base::ReadWholeFile(path);
    return text.ok() ? *text : std::string();
  };
  // This process's cgroup: "0::/path" (v2) or "N:memory:/path" (v1).
  std::string v2_dir, v1_dir;
  for (absl::string_view line : absl::StrSplit(read("/proc/self/cgroup"), '\n')) {
    const std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[0] == "0" && parts[1].empty()) v2_dir = std::string(parts[2]);
    if (absl::StrContains(parts[1], "memory")) v1_dir = std::string(parts[2]);
  }
  std::string limit, usage;
  for (const std::string& dir :
       {absl::StrCat("/sys/fs/cgroup", v2_dir), std::string("/sys/fs/cgroup")}) {
    limit = read(dir + "/memory.max");
    if (!limit.empty()) {
      usage = read(dir + "/memory.current");
      break;
    }
  }
  if (limit.empty()) {
    for (const std::string& dir :
         {absl::StrCat("/sys/fs/cgroup/memory", v1_dir), std::string("/sys/fs/cgroup/memory")}) {
      limit = read(dir + "/memory.limit_in_bytes");
      if (!limit.empty()) {
        usage = read(dir + "/memory.usage_in_bytes");
        break;
      }
    }
  }
  return ParseMachineMemory(read("/proc/meminfo"), limit, usage);
}

absl::Status CheckJobMemory(const JobMemoryEstimate& estimate, int ranks_here,
                            const MachineMemory& machine) {
  const int64_t usable = machine.usable();
  if (usable <= 0) return absl::OkStatus();
  const int64_t here = Mul(estimate.total, std::max(1, ranks_here));
  if (here <= usable) return absl::OkStatus();
  std::string largest;
  for (size_t i = 0; i < estimate.terms.size() && i < 3; ++i) {
    absl::StrAppend(&largest, i > 0 ? "; " : "", estimate.terms[i].what, " ",
                    FormatBytes(estimate.terms[i].bytes), " (", estimate.terms[i].fields, ")");
  }
  // The message starts with the fields that size the largest term.
  const std::string field =
      estimate.terms.empty() ? std::string("model") : estimate.terms[0].fields;
  return absl::ResourceExhaustedError(absl::StrCat(
      field, ": the job needs an estimated ", estimate.Describe(),
      ranks_here > 1
          ? absl::StrCat(", x ", ranks_here, " ranks on this machine = ", FormatBytes(here))
          : "",
      ", but this machine has ", machine.Describe(), ". Largest: ", largest, ". Lower those sizes",
      !estimate.terms.empty() && absl::StartsWith(estimate.terms[0].what, "expert weights")
          ? ", or spread the experts over more ranks on more machines (mpirun -np R)"
          : "",
      "."));
}

int64_t DeviceStateBytes(const JobMemoryEstimate& estimate) {
  return Add(Add(estimate.parameters, estimate.gradients),
             Mul(estimate.parameter_count, 2 * kFloat));
}

absl::Status CheckDeviceMemory(const JobMemoryEstimate& estimate, int64_t gpu_total_bytes,
                               std::string_view gpu) {
  if (gpu_total_bytes <= 0) return absl::OkStatus();
  const int64_t per_rank = DeviceStateBytes(estimate);
  if (per_rank <= gpu_total_bytes) return absl::OkStatus();
  // The largest weight term (terms are sorted largest first) names the fields to lower.
  const MemoryTerm* largest = nullptr;
  for (const MemoryTerm& t : estimate.terms) {
    if (absl::StrContains(t.what, "(weights, gradients, AdamW moments)")) {
      largest = &t;
      break;
    }
  }
  const std::string field = largest != nullptr ? largest->fields : std::string("model");
  return absl::ResourceExhaustedError(absl::StrCat(
      field, ": the parameters, their gradients and AdamW's moments alone need ",
      FormatBytes(per_rank), " on the GPU per rank (", estimate.parameter_count,
      " parameters x 16 bytes, fp32), more than ", base::AsAbsl(gpu), "'s ",
      FormatBytes(gpu_total_bytes), " before any activation. Largest: ",
      largest != nullptr ? absl::StrCat(largest->what, " ", FormatBytes(largest->bytes)) : "-",
      ". Lower those sizes, or spread the experts over more ranks, each with a GPU of its own "
      "(resources.device: cuda)."));
}

}  // namespace rackrun::jobspec
