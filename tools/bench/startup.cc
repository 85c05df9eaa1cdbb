#include "tools/bench/startup.h"

#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <utility>

namespace rackrun::bench {
namespace {

std::string BaseName(const char* path) {
  const std::string p = path != nullptr ? path : "bench";
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

}  // namespace

BenchStartup::BenchStartup(int argc, char** argv, std::string description, StartupOptions options)
    : argc_(argc),
      argv_(argv),
      options_(options),
      flags_(BaseName(argc > 0 ? argv[0] : nullptr), "[options]") {
  flags_.Describe(std::move(description));
  flags_.Switch("--json", &json_, "print the figures as JSON instead of tables");
}

std::optional<int> BenchStartup::Start() {
  if (std::optional<int> exit = flags_.ParseCommandLine(argc_, argv_)) return exit;
  if (options_.passive_openmp_wait && std::getenv("OMP_WAIT_POLICY") == nullptr) {
    // The OpenMP runtime reads the variable when it loads, so only a new image sees it.
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv_);
    std::perror("re-exec with OMP_WAIT_POLICY=passive failed; continuing with the default");
  }
  if (options_.pin_to_one_cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(sched_getcpu(), &set);
    sched_setaffinity(0, sizeof(set), &set);
  }
  return std::nullopt;
}

std::string MachineLine() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model = "?";
  bool avx512 = false;
  while (std::getline(cpuinfo, line)) {
    if (model == "?" && line.rfind("model name", 0) == 0) model = line.substr(line.find(':') + 2);
    if (line.rfind("flags", 0) == 0 && line.find(" avx512f") != std::string::npos) avx512 = true;
  }
  std::ifstream loadavg("/proc/loadavg");
  std::string l1, l5, l15;
  loadavg >> l1 >> l5 >> l15;
  return model + ", " + std::to_string(std::thread::hardware_concurrency()) + " CPUs, AVX-512 " +
         (avx512 ? "yes" : "no") + ", load average " + l1 + " " + l5 + " " + l15;
}

double LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double one = 0;
  in >> one;
  return one;
}

void WriteToOut(const std::string& file, const std::string& text) {
  if (const char* out = std::getenv("OUT"); out != nullptr && *out != '\0') {
    std::ofstream f(std::string(out) + "/" + file);
    f << text;
  }
}

}  // namespace rackrun::bench
