// The GPU engine's peak device memory for a benchmark shape, predicted on the CUDA simulator
// (runtime/cuda/sim) without a GPU: issue 35's target is c1024's xhc at <= 0.5 x PyTorch
// eager's 37.4 GiB, and the full shape takes hours a step there. What one training step
// (the step bench_gpu_train_step_bench times, twice, the peak since the engine was made)
// asks of the caching allocator is measured at reduced shapes and extrapolated:
//
//   peak(E, T) = a + b E + c T
//
// E experts (parameters, their gradients and AdamW's moments grow with E; the expert-row
// buffers hold T x top-k rows whatever E is), T = batch x seq tokens (activations; the
// attention keeps one log-sum-exp per row, nothing of seq x seq). Measured at (E1, T1),
// (E1, 2 T1), (E1, 4 T1), (E2, T1) and, as a check that seq does not matter at a given T,
// (E1, 2 T1) as half the batch at twice the seq; the table gives the fit's worst miss over
// the T points and the seq check's difference, so a term the model lacks shows. The other
// dimensions are the shape's (C, heads, blocks, F, top-k, vocab, the mode's N and k).
//
// Two figures per row: the bytes the engine asked for (requested; what
// torch.cuda.max_memory_allocated counts of PyTorch's, up to its 512-byte rounding) and the
// caching allocator's size classes (in use: the memory the blocks hold, up to 12.5% more per
// block; what bench_gpu_train_step_bench compares with PyTorch's peak). Requested is fitted as
// a whole; in use is predicted block by block: each block live at the peak (by its name) is
// fitted alike and its size class taken at the shape, since the classes are not linear.
//
//   bench_sim_step_memory [--configs c1024,demo] [--residual vanilla,xhc,...]
//                         [--experts 8,16] [--seq 32] [--batch 1] [--measure-full]
//
// --measure-full also runs the shape itself and prints its measured peaks beside the
// prediction: the check of the method where the simulator can afford it (demo).
//
// Where the peak goes: the allocator records the blocks live at the requested peak by name
// (DeviceEngine::MemoryPeakBlocks); names are grouped with their numbers replaced by #
// ("blocks.#.moe expert h13": the four layers' together), each group fitted as the total and
// predicted at the shape. A second table lists, per row, the groups of at least 1% of its
// peak, largest first, with their bytes per token and per expert.
//
// JSON: with --json on stdout, and always to $OUT/bench_sim_step_memory.json when OUT is set.
// Built only with the simulator. A prediction: bench_gpu_train_step_bench measures the peak on
// a GPU.
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "runtime/cuda/caching_allocator.h"
#include "runtime/cuda/device_probe.h"
#include "runtime/device_engine.h"
#include "tools/bench/gpu_step.h"
#include "tools/bench/startup.h"
#include "tools/bench/train_step.h"

namespace {

namespace cu = rackrun::runtime::cuda;
namespace bench = rackrun::bench;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct Options {
  std::vector<std::string> configs = {"c1024"};
  std::vector<std::string> residual = {"vanilla", "mhc", "xhc", "xhc_flash"};
  std::vector<int> experts = {8, 16};
  int seq = 32;
  int batch = 1;
  bool measure_full = false;
};

struct Peak {
  double requested = 0, in_use = 0;
  std::map<std::string, double> blocks;  // requested bytes at the peak by name
  std::map<std::string, int> counts;     // blocks of that name
};

// "blocks.2.moe expert h13" -> "blocks.#.moe expert h13": numbers that do not end a word.
std::string GroupOf(const std::string& what) {
  std::string g;
  bool in_word = false;  // the digits at i continue a word ("h13")
  for (size_t i = 0; i < what.size(); ++i) {
    const unsigned char ch = static_cast<unsigned char>(what[i]);
    if (std::isdigit(ch) == 0) {
      g += what[i];
      in_word = std::isalpha(ch) != 0;
    } else if (in_word) {
      g += what[i];
    } else if (i == 0 || std::isdigit(static_cast<unsigned char>(what[i - 1])) == 0) {
      g += '#';
    }
  }
  return g;
}

// One engine's two steps at `shape`; its peaks.
absl::StatusOr<Peak> Measure(const bench::TrainStepShape& shape, const std::string& residual) {
  absl::StatusOr<bench::GpuStepModel> model =
      bench::MakeGpuStepModel(shape, residual, "", "per_expert");
  if (!model.ok()) return model.status();
  const bench::StepTokens tokens = bench::RandomStepTokens(shape);
  for (int step = 0; step < 2; ++step) {
    if (absl::StatusOr<double> loss = bench::EngineStep(*model->engine, tokens, shape.batch);
        !loss.ok())
      return loss.status();
  }
  absl::StatusOr<rackrun::runtime::DeviceStepStats> st = model->engine->StepStats();
  if (!st.ok()) return st.status();
  Peak p;
  p.requested = static_cast<double>(st->memory_peak_requested_bytes);
  p.in_use = static_cast<double>(st->memory_peak_bytes);
  for (const auto& [what, bytes] : model->engine->MemoryPeakBlocks()) {
    p.blocks[what] += static_cast<double>(bytes);
    ++p.counts[what];
  }
  return p;
}

// a + b E + c T fitted to one of the peaks.
struct Fit {
  double a = 0, b = 0, c = 0;
  double worst_miss = 0;  // over the T points, bytes
  double At(double e, double t) const { return a + b * e + c * t; }
};

Fit FitPeaks(const std::vector<double>& t, const std::vector<double>& at_e1, double e1, double e2,
             double at_e2) {
  Fit f;
  const double n = static_cast<double>(t.size());
  double st = 0, sy = 0, stt = 0, sty = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    st += t[i];
    sy += at_e1[i];
    stt += t[i] * t[i];
    sty += t[i] * at_e1[i];
  }
  f.c = (n * sty - st * sy) / (n * stt - st * st);
  const double intercept = (sy - f.c * st) / n;  // a + b e1
  f.b = (at_e2 - (intercept + f.c * t[0])) / (e2 - e1);
  f.a = intercept - f.b * e1;
  for (size_t i = 0; i < t.size(); ++i)
    f.worst_miss = std::max(f.worst_miss, std::fabs(f.At(e1, t[i]) - at_e1[i]));
  return f;
}

// A group of blocks at the peak, fitted like the total.
struct Group {
  std::string name;
  Fit fit;
};

struct Row {
  bench::TrainStepShape shape;
  std::string residual;
  Fit requested;
  double in_use = 0;          // predicted at the shape, block by block
  std::vector<Group> groups;  // largest predicted first
  double seq_check = 0;       // in-use bytes at (E1, 2 T1, seq x 2) minus at (E1, 2 T1)
  std::optional<Peak> full;   // --measure-full: the shape itself
  std::string note;
};

// The blocks at the fit's points (T1, 2 T1, 4 T1 at E1; T1 at E2) summed by key(name), each
// key fitted over them (a key missing at a point held 0 bytes there).
std::vector<Group> FitNames(const std::vector<double>& t, const std::vector<Peak>& peaks, int e1,
                            int e2, std::string (*key)(const std::string&)) {
  std::array<std::map<std::string, double>, 4> at;
  std::set<std::string> names;
  for (size_t i = 0; i < at.size(); ++i) {
    for (const auto& [name, bytes] : peaks[i].blocks) {
      const std::string k = key(name);
      at[i][k] += bytes;
      names.insert(k);
    }
  }
  const auto bytes = [&](size_t i, const std::string& name) {
    auto it = at[i].find(name);
    return it == at[i].end() ? 0.0 : it->second;
  };
  std::vector<Group> groups;
  for (const std::string& name : names) {
    groups.push_back({name, FitPeaks(t, {bytes(0, name), bytes(1, name), bytes(2, name)}, e1, e2,
                                     bytes(3, name))});
  }
  return groups;
}

std::string SameName(const std::string& name) { return name; }

// The size classes of the blocks fitted by name, at (e, tokens): a name held by n blocks is n
// blocks of an n-th of its bytes each (n as at the first point).
double InUseAt(const std::vector<Group>& blocks, const Peak& first, double e, double tokens) {
  double bytes = 0;
  for (const Group& b : blocks) {
    auto it = first.counts.find(b.name);
    const int n = it == first.counts.end() ? 1 : it->second;
    const double each = std::max(0.0, std::ceil(b.fit.At(e, tokens) / n));
    bytes += n * static_cast<double>(cu::CachingAllocator::SizeClass(static_cast<size_t>(each)));
  }
  return bytes;
}

Row Predict(const Options& o, const bench::TrainStepShape& full, const std::string& residual) {
  Row row{full, residual, {}, 0, {}, 0, std::nullopt, ""};
  if (absl::Status s = cu::CheckGpuResidualMode(residual); !s.ok()) {
    row.note = "not in the GPU engine";
    return row;
  }
  const int e1 = o.experts[0], e2 = o.experts[1], b = o.batch, s = o.seq;
  // (experts, batch, seq): T1, 2 T1 and 4 T1 tokens at E1 (the fit's T points); T1 at E2; and
  // 2 T1 as twice the seq (the seq check against the second point).
  const std::array<std::array<int, 3>, 5> points = {
      {{e1, b, s}, {e1, 2 * b, s}, {e1, 4 * b, s}, {e2, b, s}, {e1, b, 2 * s}}};
  std::vector<Peak> peaks;
  for (const auto& [experts, batch, seq] : points) {
    bench::TrainStepShape r = full;
    r.experts = experts;
    r.batch = batch;
    r.seq = seq;
    absl::StatusOr<Peak> p = Measure(r, residual);
    if (!p.ok()) {
      row.note = absl::StrCat(experts, " experts, batch ", batch, " x seq ", seq, ": ",
                              p.status().message());
      return row;
    }
    peaks.push_back(*p);
  }
  std::vector<double> t, req;
  for (int i = 0; i < 3; ++i) {
    t.push_back(static_cast<double>(points[static_cast<size_t>(i)][1]) * s);
    req.push_back(peaks[static_cast<size_t>(i)].requested);
  }
  row.requested = FitPeaks(t, req, e1, e2, peaks[3].requested);
  row.groups = FitNames(t, peaks, e1, e2, &GroupOf);
  const double e = full.experts, tokens = full.tokens();
  row.in_use = InUseAt(FitNames(t, peaks, e1, e2, &SameName), peaks[0], e, tokens);
  std::sort(row.groups.begin(), row.groups.end(), [&](const Group& x, const Group& y) {
    return x.fit.At(e, tokens) > y.fit.At(e, tokens);
  });
  row.seq_check = peaks[4].in_use - peaks[1].in_use;
  if (o.measure_full) {
    absl::StatusOr<Peak> p = Measure(full, residual);
    if (!p.ok()) {
      row.note = absl::StrCat("the full shape: ", p.status().message());
      return row;
    }
    row.full = *p;
  }
  return row;
}

nlohmann::json GroupsJson(const Row& r) {
  nlohmann::json groups = nlohmann::json::array();
  const double e = r.shape.experts, t = r.shape.tokens();
  for (const Group& g : r.groups) {
    groups.push_back({{"name", g.name},
                      {"requested_bytes", g.fit.At(e, t)},
                      {"bytes_per_token", g.fit.c},
                      {"bytes_per_expert", g.fit.b}});
  }
  return groups;
}

nlohmann::json Json(const Options& o, const std::vector<Row>& rows) {
  nlohmann::json j;
  j["bench"] = "sim_step_memory";
  j["experts"] = o.experts;
  j["seq"] = o.seq;
  j["batch"] = o.batch;
  j["rows"] = nlohmann::json::array();
  for (const Row& r : rows) {
    const double e = r.shape.experts, t = r.shape.tokens();
    j["rows"].push_back({{"config", r.shape.name},
                         {"shape", r.shape.Describe()},
                         {"tokens", r.shape.tokens()},
                         {"residual", r.residual},
                         {"note", r.note},
                         {"requested_bytes", r.requested.At(e, t)},
                         {"in_use_bytes", r.in_use},
                         {"bytes_per_token", r.requested.c},
                         {"bytes_per_expert", r.requested.b},
                         {"fit_worst_miss_bytes", r.requested.worst_miss},
                         {"measured_requested_bytes", r.full ? r.full->requested : -1},
                         {"measured_in_use_bytes", r.full ? r.full->in_use : -1},
                         {"seq_check_bytes", r.seq_check},
                         {"groups", GroupsJson(r)}});
  }
  return j;
}

// Per row, the groups of blocks that hold at least 1% of its predicted peak.
void PrintGroups(const std::vector<Row>& rows) {
  bench::Table t({{"config", 6, true},
                  {"residual", 10, true},
                  {"blocks at the peak (numbers as #)", 42, true},
                  {"GiB", 6},
                  {"share", 5},
                  {"KiB/token", 9},
                  {"MiB/expert", 10}});
  for (const Row& r : rows) {
    if (!r.note.empty()) continue;
    const double e = r.shape.experts, tok = r.shape.tokens();
    const double total = r.requested.At(e, tok);
    double rest = 0;
    for (const Group& g : r.groups) {
      const double bytes = g.fit.At(e, tok);
      if (bytes < 0.01 * total) {
        rest += bytes;
        continue;
      }
      t.AddRow({r.shape.name, r.residual, g.name, absl::StrFormat("%.3f", bytes / kGiB),
                absl::StrFormat("%.1f%%", 100.0 * bytes / total),
                absl::StrFormat("%.1f", g.fit.c / 1024.0),
                absl::StrFormat("%.1f", g.fit.b / (1024.0 * 1024.0))});
    }
    t.AddRow({r.shape.name, r.residual, "(the rest)", absl::StrFormat("%.3f", rest / kGiB),
              absl::StrFormat("%.1f%%", 100.0 * rest / total), "", ""});
  }
  std::printf(
      "\nWhere each row's peak goes (the allocations live at it, grouped and fitted as the "
      "total)\n%s",
      t.ToString().c_str());
}

void PrintTable(const Options& o, const std::vector<Row>& rows) {
  std::printf(
      "One training step's peak device memory, predicted from the CUDA simulator's caching "
      "allocator at %d and %d experts, batch %d-%d x seq %d\n",
      o.experts[0], o.experts[1], o.batch, 4 * o.batch, o.seq);
  bench::Table t({{"config", 6, true},
                  {"residual", 10, true},
                  {"tokens", 6},
                  {"requested GiB", 13},
                  {"in use GiB", 10},
                  {"KiB/token", 9},
                  {"MiB/expert", 10},
                  {"fit miss", 8},
                  {"seq check", 9},
                  {"measured GiB", 13},
                  {"note", 4, true, 2}});
  for (const Row& r : rows) {
    const double e = r.shape.experts, tok = r.shape.tokens();
    const auto f = [&](double v, int digits) {
      return r.note.empty() ? absl::StrFormat("%.*f", digits, v) : std::string("-");
    };
    std::string note = r.note;
    if (note.empty() && r.shape.name == "c1024" && r.residual == "xhc") {
      note = absl::StrFormat("target <= %.1f GiB (0.5 x PyTorch eager's %.1f)",
                             bench::kTargetXhcPeakFraction * bench::kTorchEagerXhcPeakGiB,
                             bench::kTorchEagerXhcPeakGiB);
    }
    t.AddRow({r.shape.name, r.residual, std::to_string(r.shape.tokens()),
              f(r.requested.At(e, tok) / kGiB, 3), f(r.in_use / kGiB, 3),
              f(r.requested.c / 1024.0, 1), f(r.requested.b / (1024.0 * 1024.0), 1),
              f(r.requested.worst_miss / (1024.0 * 1024.0), 1) + (r.note.empty() ? " MiB" : ""),
              f(r.seq_check / (1024.0 * 1024.0), 1) + (r.note.empty() ? " MiB" : ""),
              r.full
                  ? absl::StrFormat("%.3f / %.3f", r.full->requested / kGiB, r.full->in_use / kGiB)
                  : "-",
              note});
  }
  std::printf("%s", t.ToString().c_str());
  std::printf(
      "(requested: the bytes the engine asked for; in use: the caching allocator's size "
      "classes of the blocks at the peak, each fitted; fit miss: the worst difference between "
      "the requested fit and a measured requested peak; "
      "seq check: in use at twice the seq and half the batch minus at the same tokens; measured: "
      "requested / in use at the shape itself, with --measure-full)\n");
  PrintGroups(rows);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  bench::BenchStartup startup(
      argc, argv,
      "A training step's peak device memory on the GPU engine, predicted from reduced shapes\n"
      "on the CUDA simulator (this file's header says how).\n");
  rackrun::flags::FlagSet& flags = startup.flags();
  flags.List("--configs", &o.configs, "LIST", "model shapes: demo, c1024");
  flags.List("--residual", &o.residual, "LIST", "residual modes");
  flags.List("--experts", &o.experts, "E1,E2", "the two expert counts measured");
  flags.Int("--seq", &o.seq, "N", "the seq of the measured steps");
  flags.Int("--batch", &o.batch, "N", "the smallest batch measured (then x2, x4)");
  flags.Switch("--measure-full", &o.measure_full,
               "also run the shape itself to check the prediction (demo: minutes; c1024: hours)");
  if (std::optional<int> exit = startup.Start()) return *exit;
  if (o.experts.size() != 2 || o.experts[0] < 1 || o.experts[1] <= o.experts[0])
    return flags.Fail(
        absl::InvalidArgumentError("--experts: two counts, the second larger (e.g. 8,16)"));
  if (o.seq < 1 || o.batch < 1)
    return flags.Fail(absl::InvalidArgumentError("--seq and --batch: at least 1"));
  std::vector<std::string> paths = {"per_expert"};
  if (std::optional<int> exit = bench::CheckGpuStepFlags(flags, paths, o.residual)) return *exit;
  std::vector<Row> rows;
  for (const std::string& name : o.configs) {
    absl::StatusOr<bench::TrainStepShape> s = bench::ShapeNamed(name, "--configs");
    if (!s.ok()) return flags.Fail(s.status());
    if (s->top_k > o.experts[0])
      return flags.Fail(absl::InvalidArgumentError(
          absl::StrCat("--experts: at least ", name, "'s top-k (", s->top_k, ")")));
    for (const std::string& mode : o.residual) {
      rows.push_back(Predict(o, *s, mode));
      std::fprintf(stderr, "%s: %s %s: %s\n", startup.program().c_str(), name.c_str(), mode.c_str(),
                   rows.back().note.empty()
                       ? absl::StrFormat("%.2f GiB requested",
                                         rows.back().requested.At(s->experts, s->tokens()) / kGiB)
                             .c_str()
                       : rows.back().note.c_str());
    }
  }
  const nlohmann::json j = Json(o, rows);
  bench::WriteToOut("bench_sim_step_memory.json", j.dump(2) + "\n");
  if (startup.json()) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  PrintTable(o, rows);
  return 0;
}
