// rackrun: the user's CLI. The job client (submit, status, watch, cancel, list, workers)
// and the offline tools (plan, data, train).
#include <cstdio>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "base/signals.h"
#include "flags/flags.h"
#include "tools/rackrun/command.h"

namespace {

struct Command {
  std::string_view name;
  int (*run)(const rackrun::cli::Args&);
  std::string_view summary;
};

constexpr Command kCommands[] = {
    {"submit", rackrun::cli::SubmitCommand, "queue a job (JobSpec file) on the rack coordinator"},
    {"status", rackrun::cli::StatusCommand, "show a job: state, attempts, failures, progress"},
    {"watch", rackrun::cli::WatchCommand, "follow a job to its end (exit code: its outcome)"},
    {"cancel", rackrun::cli::CancelCommand, "cancel a queued or running job"},
    {"list", rackrun::cli::ListCommand, "list jobs, newest first"},
    {"workers", rackrun::cli::WorkersCommand, "list the workers registered with the coordinator"},
    {"plan", rackrun::cli::PlanCommand,
     "replay load traces (or generated loads) through balancing policies"},
    {"data", rackrun::cli::DataCommand,
     "tokenize text or JSONL into Megatron datasets; train a SentencePiece tokenizer"},
    {"train", rackrun::cli::TrainCommand, "run a training job (JobSpec file) in this process"},
    {"export", rackrun::cli::ExportCommand, "write a checkpoint's weights as safetensors"},
    {"import", rackrun::cli::ImportCommand, "make a checkpoint from exported safetensors"},
};

void PrintUsage(std::FILE* out) {
  std::fprintf(out, "usage: rackrun COMMAND [options]\n\ncommands:\n");
  for (const Command& c : kCommands) {
    std::fprintf(out, "  %-8.*s %.*s\n", static_cast<int>(c.name.size()), c.name.data(),
                 static_cast<int>(c.summary.size()), c.summary.data());
  }
  std::fprintf(out, "\n'rackrun COMMAND --help' describes a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  rackrun::base::IgnoreSigpipe();
  if (argc < 2) {
    PrintUsage(stderr);
    return 2;
  }
  const std::string_view name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    PrintUsage(stdout);
    return 0;
  }
  for (const Command& c : kCommands) {
    if (c.name != name) continue;
    // The process boundary: an allocation failure anywhere in a command becomes a message
    // and exit status 1, never an abort (std::terminate) with a core dump.
    try {
      return c.run(rackrun::cli::Args(argv + 2, argv + argc));
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr,
                   "rackrun %s: out of memory: an allocation failed; lower the sizes in the "
                   "input (spec, trace or text) or free memory and retry\n",
                   argv[1]);
      return 1;
    }
  }
  return rackrun::flags::PrintUsageError("rackrun",
                                         std::string("'") + argv[1] + "': unknown command");
}
