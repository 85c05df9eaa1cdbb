#include "tools/bench/train_step.h"

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace rackrun::bench {
namespace {

// Single quotes for the shell.
std::string Quoted(absl::string_view s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

// The child's environment prefix (see the header: RACKRUN_CHILD_LD_LIBRARY_PATH).
std::string ChildEnvironment() {
  const char* lib = std::getenv("RACKRUN_CHILD_LD_LIBRARY_PATH");
  return lib != nullptr ? "LD_LIBRARY_PATH=" + Quoted(lib) + " " : "";
}

std::string Thousands(double v) { return Fixed(v / 1e3, 1) + "k"; }

TargetCheck Check(std::string target, std::optional<double> value, absl::string_view missing,
                  bool pass, const std::string& shown) {
  if (!value.has_value()) return {std::move(target), std::string(missing), "n/a"};
  return {std::move(target), shown, pass ? "pass" : "miss"};
}

}  // namespace

std::string TrainStepShape::Describe() const {
  return absl::StrFormat("%d blocks, C=%d, %d experts top-%d, F=%d, vocab %d", blocks, width,
                         experts, top_k, expert_hidden, vocab);
}

TrainStepShape DemoShape() {
  TrainStepShape s;
  s.name = "demo";
  return s;
}

TrainStepShape C1024Shape() {
  TrainStepShape s;
  s.name = "c1024";
  s.width = 1024;
  s.heads = 16;
  s.experts = 64;
  s.top_k = 4;
  s.expert_hidden = 1024;
  s.seq = 1024;
  return s;
}

absl::StatusOr<TrainStepShape> ShapeNamed(absl::string_view name, absl::string_view flag) {
  if (name == "demo") return DemoShape();
  if (name == "c1024") return C1024Shape();
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": unknown configuration \"", name, "\"; use demo or c1024"));
}

runtime::ModelConfig ModelConfigOf(const TrainStepShape& shape, const std::string& residual) {
  runtime::ModelConfig c;
  c.vocab = shape.vocab;
  c.width = shape.width;
  c.blocks = shape.blocks;
  c.heads = shape.heads;
  c.seq_len = shape.seq;
  c.residual = residual;  // xhc: N=16, k=4, m=2 (mode defaults)
  c.moe.experts = shape.experts;
  c.moe.top_k = shape.top_k;
  c.moe.expert_hidden = shape.expert_hidden;
  return c;
}

bool TorchHasMode(absl::string_view residual) {
  return residual == "vanilla" || residual == "mhc" || residual == "xhc";
}

absl::StatusOr<std::string> TorchReferenceScript() {
  const std::string beside_sources = std::string(RACKRUN_SOURCE_DIR) + "/tools/bench";
  for (const std::string& dir : {beside_sources, std::string("tools/bench")}) {
    const std::string path = dir + "/torch_reference.py";
    std::error_code ec;
    if (std::filesystem::is_regular_file(path, ec)) return path;
  }
  return absl::NotFoundError(absl::StrCat("torch_reference.py is neither in ", beside_sources,
                                          " nor in ./tools/bench (run from a checkout's root)"));
}

std::string TorchReferenceCommand(const TorchOptions& o, const std::string& script,
                                  const TrainStepShape& s, absl::string_view residual) {
  std::string cmd = ChildEnvironment();
  if (o.threads > 0) absl::StrAppend(&cmd, "OMP_NUM_THREADS=", o.threads, " ");
  absl::StrAppend(&cmd, Quoted(o.python), " ", Quoted(script), " --json --residual ", residual,
                  " --batch ", s.batch, " --seq ", s.seq, " --steps ", o.steps, " --warmup ",
                  o.warmup);
  if (o.threads > 0) absl::StrAppend(&cmd, " --threads ", o.threads);
  absl::StrAppend(&cmd, " --expert-hidden ", s.expert_hidden, " --vocab ", s.vocab, " --width ",
                  s.width, " --blocks ", s.blocks, " --heads ", s.heads, " --experts ", s.experts,
                  " --top-k ", s.top_k);
  if (o.device != "cpu") absl::StrAppend(&cmd, " --device ", o.device);
  if (!o.precision.empty()) absl::StrAppend(&cmd, " --precision ", o.precision);
  if (o.compile) absl::StrAppend(&cmd, " --compile");
  return cmd + " 2>&1";
}

absl::StatusOr<TorchResult> ParseTorchOutput(absl::string_view output, int exit_status) {
  const size_t brace = output.rfind("\n{");
  const absl::string_view last =
      brace == absl::string_view::npos ? output : output.substr(brace + 1);
  const nlohmann::json j = nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
  const auto failed = [&] {
    return absl::UnavailableError(absl::StrCat("torch reference failed: ", output.substr(0, 200)));
  };
  if (exit_status != 0 || j.is_discarded() || !j.is_object()) return failed();
  for (const char* key :
       {"tokens_per_s", "step_s", "optimizer_s", "first_loss", "parameters", "torch"}) {
    if (!j.contains(key)) return failed();
  }
  TorchResult r;
  r.tokens_per_s = j["tokens_per_s"].get<double>();
  r.step_s = j["step_s"].get<double>();
  r.optimizer_s = j["optimizer_s"].get<double>();
  r.first_loss = j["first_loss"].get<double>();
  r.parameters = j["parameters"].get<int64_t>();
  r.torch_version = j["torch"].get<std::string>();
  r.peak_memory_bytes = j.value("peak_memory_bytes", int64_t{0});
  r.device_name = j.value("device_name", std::string());
  return r;
}

absl::StatusOr<TorchResult> RunTorchReference(const TorchOptions& options,
                                              const TrainStepShape& shape,
                                              absl::string_view residual) {
  absl::StatusOr<std::string> script = TorchReferenceScript();
  if (!script.ok()) return script.status();
  const std::string cmd = TorchReferenceCommand(options, *script, shape, residual);
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return absl::UnavailableError("could not start " + options.python);
  std::string out;
  std::array<char, 4096> buf;
  while (fgets(buf.data(), buf.size(), pipe) != nullptr) out += buf.data();
  return ParseTorchOutput(out, pclose(pipe));
}

absl::Status CheckTorch(const std::string& python, absl::string_view device) {
  const std::string env = ChildEnvironment();
  if (std::system((env + Quoted(python) + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(python,
                     " cannot import torch (Debian's python3-torch: tools/setup --torch; "
                     "on a GPU machine, the Python with NVIDIA's wheels)"));
  }
  if (device == "cuda") {
    const std::string probe = env + Quoted(python) +
                              " -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() "
                              "else 1)' >/dev/null 2>&1";
    if (std::system(probe.c_str()) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(python, " has torch, but torch.cuda.is_available() is false"));
    }
  }
  return absl::OkStatus();
}

std::vector<TargetCheck> CheckTargets(const std::string& shape,
                                      const std::vector<std::string>& modes,
                                      const std::vector<StepFigures>& figures) {
  const auto of = [&](absl::string_view mode) -> StepFigures {
    for (size_t i = 0; i < modes.size() && i < figures.size(); ++i)
      if (modes[i] == mode) return figures[i];
    return {};
  };
  std::vector<TargetCheck> checks;
  if (shape == "c1024") {
    const StepFigures xhc = of("xhc"), vanilla = of("vanilla");
    checks.push_back(Check("xhc >= 80k tokens/s", xhc.tokens_per_s, "xhc not measured",
                           xhc.tokens_per_s.value_or(0) >= kTargetXhcTokensPerS,
                           Thousands(xhc.tokens_per_s.value_or(0))));
    checks.push_back(Check("vanilla >= 83k tokens/s", vanilla.tokens_per_s, "vanilla not measured",
                           vanilla.tokens_per_s.value_or(0) >= kTargetVanillaTokensPerS,
                           Thousands(vanilla.tokens_per_s.value_or(0))));
    std::optional<double> ratio;
    if (xhc.step_s.has_value() && vanilla.step_s.has_value() && *vanilla.step_s > 0)
      ratio = *xhc.step_s / *vanilla.step_s;
    checks.push_back(Check("xhc step <= 1.15x vanilla's", ratio, "xhc or vanilla not measured",
                           ratio.value_or(0) <= kTargetXhcStepOverVanilla,
                           Fixed(ratio.value_or(0), 2) + "x"));
    const double limit_gib = kTargetXhcPeakFraction * kTorchEagerXhcPeakGiB;
    const double peak_gib = xhc.peak_bytes.value_or(0) / static_cast<double>(int64_t{1} << 30);
    checks.push_back(Check(absl::StrFormat("xhc peak <= %.1f GiB (0.5 x 37.4)", limit_gib),
                           xhc.peak_bytes, "xhc not measured", peak_gib <= limit_gib,
                           Fixed(peak_gib, 1) + " GiB"));
    for (const auto& [mode, f, factor] :
         {std::tuple("xhc", xhc, kTargetXhcOverCompile),
          std::tuple("vanilla", vanilla, kTargetVanillaOverCompile)}) {
      if (!f.torch_compile_tokens_per_s.has_value()) continue;
      std::optional<double> over;
      if (f.tokens_per_s.has_value() && *f.torch_compile_tokens_per_s > 0)
        over = *f.tokens_per_s / *f.torch_compile_tokens_per_s;
      checks.push_back(Check(absl::StrFormat("%s >= %.1fx torch.compile (this run)", mode, factor),
                             over, absl::StrCat(mode, " not measured"), over.value_or(0) >= factor,
                             Fixed(over.value_or(0), 2) + "x"));
    }
  } else if (shape == "demo") {
    for (const std::string& mode : modes) {
      const StepFigures f = of(mode);
      std::optional<double> ratio;
      if (f.tokens_per_s.has_value() && f.torch_tokens_per_s.has_value() &&
          *f.torch_tokens_per_s > 0) {
        ratio = *f.tokens_per_s / *f.torch_tokens_per_s;
      }
      const char* missing =
          !f.tokens_per_s.has_value() ? "not measured" : "no PyTorch figure in this run";
      checks.push_back(Check(mode + " above PyTorch eager", ratio, missing, ratio.value_or(0) > 1.0,
                             Fixed(ratio.value_or(0), 2) + "x"));
    }
  }
  return checks;
}

std::string Table::Line(const std::vector<std::string>& cells) const {
  std::string line;
  for (size_t i = 0; i < columns_.size(); ++i) {
    const Column& c = columns_[i];
    if (i > 0) line.append(static_cast<size_t>(c.gap), ' ');
    const std::string cell = i < cells.size() ? cells[i] : "";
    const size_t pad =
        cell.size() < static_cast<size_t>(c.width) ? static_cast<size_t>(c.width) - cell.size() : 0;
    if (!c.left) line.append(pad, ' ');
    line += cell;
    if (c.left) line.append(pad, ' ');
  }
  return line + "\n";
}

std::string Table::ToString() const {
  std::vector<std::string> headers;
  for (const Column& c : columns_) headers.push_back(c.header);
  std::string out = Line(headers);
  for (const auto& row : rows_) out += Line(row);
  return out;
}

std::string Fixed(double value, int decimals) { return absl::StrFormat("%.*f", decimals, value); }

}  // namespace rackrun::bench
