// The start-up every benchmark shares (tools/bench/*_bench.cc): its flags on one
// flags::FlagSet named after the program, with --json ("the same figures as JSON") and
// --help declared for it; the OpenMP wait policy; the CPU a single-threaded benchmark runs
// on; and the machine it reports next to its figures.
//
//   int main(int argc, char** argv) {
//     BenchStartup bench(argc, argv, "Relay vs direct fan-out ...",
//                        {.passive_openmp_wait = true});
//     bench.flags().Int("--reps", &reps, "N", "repetitions").Range(1);
//     if (std::optional<int> exit = bench.Start()) return *exit;
//     ... measure; bench.json() picks the output ...
//   }
//
// Start parses first (a usage error or --help exits before anything else happens), then
// applies the options. Not thread-safe: call it from main before any thread starts.
#ifndef RACKRUN_TOOLS_BENCH_STARTUP_H_
#define RACKRUN_TOOLS_BENCH_STARTUP_H_

#include <optional>
#include <string>

#include "flags/flags.h"

namespace rackrun::bench {

struct StartupOptions {
  // Re-executes the program with OMP_WAIT_POLICY=passive when the variable is unset:
  // OpenMP threads that spin while they wait cost the other ranks' compute on an
  // oversubscribed machine.
  bool passive_openmp_wait = false;
  // Pins the process to the CPU it starts on (a single-threaded benchmark: no migration
  // between CPUs in the middle of a timing).
  bool pin_to_one_cpu = false;
};

class BenchStartup {
 public:
  // The program is argv[0]'s base name; `description` heads its help.
  BenchStartup(int argc, char** argv, std::string description, StartupOptions options = {});

  // Where the benchmark declares its own flags, before Start.
  flags::FlagSet& flags() { return flags_; }

  // Parses the command line and applies the options. nullopt: go on; otherwise the exit
  // code (0 after --help, 2 after a usage error, both printed). May not return at all
  // (the re-execution for passive_openmp_wait).
  std::optional<int> Start();

  // --json was given.
  bool json() const { return json_; }
  const std::string& program() const { return flags_.program(); }

 private:
  int argc_;
  char** argv_;
  StartupOptions options_;
  flags::FlagSet flags_;
  bool json_ = false;
};

// "MODEL NAME, N CPUs, AVX-512 yes|no, load average A B C" (from /proc).
std::string MachineLine();

// The 1-minute load average (/proc/loadavg); 0 when unreadable.
double LoadAverage();

// Writes `text` to $OUT/`file` when OUT is set and not empty (the device check collects the
// benchmarks' JSON from there); does nothing otherwise.
void WriteToOut(const std::string& file, const std::string& text);

}  // namespace rackrun::bench

#endif  // RACKRUN_TOOLS_BENCH_STARTUP_H_
