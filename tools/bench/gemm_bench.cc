// The GEMM libraries this machine offers, side by side in one run, on the GEMM shapes of the
// demo model (C=128, 2048 tokens) and of a C=1024 model (8192 tokens, 64 experts top-4,
// F=1024): what the runtime runs (OpenBLAS with the kernels this CPU's features call for,
// threaded as runtime/cpu/gemm.h chooses, and both ways of threading it), OpenBLAS forced to
// older kernel sets (what a CPU newer than OpenBLAS's model table gets), BLIS and oneDNN
// (both pick kernels by CPU features at run time).
//
//   bench_gemm_bench [--threads T] [--reps 15] [--json]
//
// Every candidate runs in a child process of this program: a library chooses its kernels
// when it loads, so each needs a fresh process. A library that is not installed is listed as
// such (BLIS and oneDNN are optional: `tools/setup --bench` installs Debian's
// libblis4-openmp and libdnnl2). Figures: GFLOP/s, the median of --reps calls after three
// warm-up calls, at 1 thread and at T threads (default: all CPUs).
#include <dlfcn.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/statistics.h"
#include "nlohmann/json.hpp"
#include "runtime/cpu/blas.h"
#include "runtime/cpu/gemm.h"
#include "tools/bench/startup.h"

namespace {

namespace cpu = rackrun::runtime::cpu;

struct Shape {
  const char* model;
  const char* what;
  int m, n, k;
  bool tb;  // op(B) = B^T (a weight stored output-major, as the layers store them)
};

// Forward shapes of one step (the backward's are the same products transposed).
constexpr std::array<Shape, 10> kShapes = {{
    {"demo", "QKV projection", 2048, 384, 128, true},
    {"demo", "attention output", 2048, 128, 128, true},
    {"demo", "expert up+gate (256 tokens)", 256, 512, 128, true},
    {"demo", "expert down", 256, 128, 256, true},
    {"demo", "LM head (vocab 256)", 2048, 256, 128, true},
    {"c1024", "QKV projection", 8192, 3072, 1024, true},
    {"c1024", "attention output", 8192, 1024, 1024, true},
    {"c1024", "expert up+gate (512 tokens)", 512, 2048, 1024, true},
    {"c1024", "expert down", 512, 1024, 1024, true},
    {"c1024", "LM head (vocab 256)", 8192, 256, 1024, true},
}};

using Sgemm = std::function<void(int threads, const Shape&, const float*, const float*, float*)>;

// Median GFLOP/s of `reps` calls after three warm-ups.
double Measure(const Sgemm& gemm, int threads, const Shape& s, int reps) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> a(static_cast<size_t>(s.m) * s.k), b(static_cast<size_t>(s.k) * s.n),
      c(static_cast<size_t>(s.m) * s.n);
  for (float& x : a) x = u(rng);
  for (float& x : b) x = u(rng);
  std::vector<double> seconds;
  for (int r = 0; r < reps + 3; ++r) {
    const auto start = std::chrono::steady_clock::now();
    gemm(threads, s, a.data(), b.data(), c.data());
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (r >= 3) seconds.push_back(t);
  }
  return 2.0 * s.m * s.n * s.k / rackrun::base::Median(seconds) / 1e9;
}

// One candidate: its kernels' name, and GEMM calls by thread count.
struct Candidate {
  std::string kernels;  // empty: unavailable, `note` says why
  std::string note;
  std::map<std::string, Sgemm> ways;  // "runtime", "split", "library", or "own"
};

Candidate OpenBlasCandidate() {
  Candidate c;
  c.kernels = cpu::BlasDescription();
  const auto way = [](std::optional<cpu::GemmThreading> how) -> Sgemm {
    return [how](int threads, const Shape& s, const float* a, const float* b, float* out) {
      const int ldb = s.tb ? s.k : s.n;
      if (!how) {
        omp_set_num_threads(threads);
        cpu::Gemm<float>(false, s.tb, s.m, s.n, s.k, 1.0f, a, s.k, b, ldb, 0.0f, out, s.n);
      } else {
        cpu::GemmWith<float>(*how, threads, false, s.tb, s.m, s.n, s.k, 1.0f, a, s.k, b, ldb, 0.0f,
                             out, s.n);
      }
    };
  };
  c.ways["runtime"] = way(std::nullopt);
  c.ways["split"] = way(cpu::GemmThreading::kSplit);
  if (cpu::Blas().openmp) c.ways["library"] = way(cpu::GemmThreading::kLibrary);
  return c;
}

Candidate BlisCandidate() {
  Candidate c;
  const std::string path = "/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4";
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    c.note = "BLIS not installed (tools/setup --bench: libblis4-openmp)";
    return c;
  }
  using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                              int, float, float*, int);
  const auto sgemm = reinterpret_cast<CblasSgemm>(dlsym(h, "cblas_sgemm"));
  const auto set_threads = reinterpret_cast<void (*)(long)>(dlsym(h, "bli_thread_set_num_threads"));
  const auto arch_id = reinterpret_cast<int (*)()>(dlsym(h, "bli_arch_query_id"));
  const auto arch_name = reinterpret_cast<const char* (*)(int)>(dlsym(h, "bli_arch_string"));
  const auto version = reinterpret_cast<const char* (*)()>(dlsym(h, "bli_info_get_version_str"));
  if (sgemm == nullptr || set_threads == nullptr || arch_id == nullptr || arch_name == nullptr) {
    c.note = absl::StrCat(path, " lacks cblas_sgemm or its thread and arch queries");
    return c;
  }
  c.kernels = absl::StrCat("BLIS ", version != nullptr ? version() : "?", " ", arch_name(arch_id()),
                           " kernels (OpenMP build)");
  c.ways["own"] = [sgemm, set_threads](int threads, const Shape& s, const float* a, const float* b,
                                       float* out) {
    set_threads(threads);
    sgemm(cpu::kCblasRowMajor, cpu::kCblasNoTrans, s.tb ? cpu::kCblasTrans : cpu::kCblasNoTrans,
          s.m, s.n, s.k, 1.0f, a, s.k, b, s.tb ? s.k : s.n, 0.0f, out, s.n);
  };
  return c;
}

Candidate OneDnnCandidate() {
  Candidate c;
  void* h = dlopen("libdnnl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    c.note = "oneDNN not installed (tools/setup --bench: libdnnl2)";
    return c;
  }
  using DnnlSgemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t,
                            const float*, int64_t, float, float*, int64_t);
  struct Version {
    int major, minor, patch;
    const char* hash;
    unsigned cpu_runtime, gpu_runtime;
  };
  const auto sgemm = reinterpret_cast<DnnlSgemm>(dlsym(h, "dnnl_sgemm"));
  const auto version = reinterpret_cast<const Version* (*)()>(dlsym(h, "dnnl_version"));
  const auto isa = reinterpret_cast<int (*)()>(dlsym(h, "dnnl_get_effective_cpu_isa"));
  if (sgemm == nullptr) {
    c.note = "libdnnl.so.2 lacks dnnl_sgemm";
    return c;
  }
  const Version* v = version != nullptr ? version() : nullptr;
  c.kernels = v != nullptr
                  ? absl::StrCat("oneDNN ", v->major, ".", v->minor, ".", v->patch,
                                 " (effective ISA code ", isa != nullptr ? isa() : -1, ", OpenMP)")
                  : "oneDNN";
  c.ways["own"] = [sgemm](int threads, const Shape& s, const float* a, const float* b, float* out) {
    omp_set_num_threads(threads);  // oneDNN's Debian build threads with OpenMP
    sgemm('N', s.tb ? 'T' : 'N', s.m, s.n, s.k, 1.0f, a, s.k, b, s.tb ? s.k : s.n, 0.0f, out, s.n);
  };
  return c;
}

// The child: measures one candidate, prints one JSON object.
int RunChild(const std::string& name, int threads, int reps) {
  Candidate c = name == "blis"     ? BlisCandidate()
                : name == "onednn" ? OneDnnCandidate()
                                   : OpenBlasCandidate();
  nlohmann::json j;
  j["candidate"] = name;
  j["kernels"] = c.kernels;
  j["note"] = c.note;
  if (name.rfind("openblas", 0) == 0) j["threading"] = cpu::GemmDescription(threads);
  j["rows"] = nlohmann::json::array();
  for (const auto& [way, gemm] : c.ways) {
    for (const Shape& s : kShapes) {
      j["rows"].push_back({{"way", way},
                           {"model", s.model},
                           {"what", s.what},
                           {"m", s.m},
                           {"n", s.n},
                           {"k", s.k},
                           {"gflops_1", Measure(gemm, 1, s, reps)},
                           {"gflops_t", Measure(gemm, threads, s, reps)}});
    }
  }
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

std::string RunCapture(const std::string& command) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return out;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  pclose(pipe);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int reps = 15;
  std::string child;
  rackrun::bench::BenchStartup bench(argc, argv,
                                     "GEMM libraries side by side on the demo and C=1024 shapes",
                                     {.passive_openmp_wait = true});
  bench.flags().Int("--threads", &threads, "T", "threads for the threaded figures").Range(1);
  bench.flags().Int("--reps", &reps, "N", "timed calls per figure (median)").Range(1);
  bench.flags().String("--child", &child, "NAME", "internal: measure one candidate").Hidden();
  if (std::optional<int> exit = bench.Start()) return *exit;
  if (!child.empty()) return RunChild(child, threads, reps);

  // Candidates: the runtime's OpenBLAS, OpenBLAS with older kernel sets (AVX2 and the SSE3
  // set a CPU unknown to OpenBLAS 0.3.21 falls back to), BLIS, oneDNN.
  const std::string best = cpu::CoreForFeatures(cpu::DetectCpuVectorFeatures());
  std::vector<std::pair<std::string, std::string>> runs = {{"openblas", ""}};
  for (const char* core : {"Haswell", "Prescott"}) {
    if (cpu::CoreLevel(core) < cpu::CoreLevel(best)) {
      runs.emplace_back(absl::StrCat("openblas-", core), absl::StrCat("OPENBLAS_CORETYPE=", core));
    }
  }
  runs.emplace_back("blis", "");
  runs.emplace_back("onednn", "");
  std::vector<nlohmann::json> results;
  for (const auto& [name, env] : runs) {
    const std::string command = absl::StrCat(env, " /proc/", getpid(), "/exe --child ", name,
                                             " --threads ", threads, " --reps ", reps, " 2>&1");
    const std::string out = RunCapture(command);
    nlohmann::json j = nlohmann::json::parse(out.substr(out.find('{')), nullptr, false);
    if (j.is_discarded()) j = {{"candidate", name}, {"note", "failed: " + out}};
    results.push_back(j);
  }
  if (bench.json()) {
    nlohmann::json all;
    all["machine"] = rackrun::bench::MachineLine();
    all["threads"] = threads;
    all["candidates"] = results;
    std::printf("%s\n", all.dump().c_str());
    return 0;
  }
  std::printf("GEMM libraries on %s; GFLOP/s, median of %d calls; 1 thread / %d threads\n",
              rackrun::bench::MachineLine().c_str(), reps, threads);
  for (const nlohmann::json& j : results) {
    std::printf("\n%s: %s%s\n", j.value("candidate", "?").c_str(), j.value("kernels", "").c_str(),
                j.value("note", "").c_str());
    if (j.contains("threading")) std::printf("  %s\n", j["threading"].get<std::string>().c_str());
    if (!j.contains("rows") || j["rows"].empty()) continue;
    std::printf("  %-8s %-6s %-28s %5s %5s %5s %9s %9s\n", "way", "model", "GEMM", "m", "n", "k",
                "1 thread", absl::StrCat(threads, " threads").c_str());
    for (const nlohmann::json& r : j["rows"]) {
      std::printf("  %-8s %-6s %-28s %5d %5d %5d %9.1f %9.1f\n",
                  r["way"].get<std::string>().c_str(), r["model"].get<std::string>().c_str(),
                  r["what"].get<std::string>().c_str(), r["m"].get<int>(), r["n"].get<int>(),
                  r["k"].get<int>(), r["gflops_1"].get<double>(), r["gflops_t"].get<double>());
    }
  }
  return 0;
}
