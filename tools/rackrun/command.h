// Subcommands of the `rackrun` CLI. Each takes the arguments after its own name and
// returns the process exit code (0 ok, 1 failure, 2 usage error).
#ifndef RACKRUN_TOOLS_RACKRUN_COMMAND_H_
#define RACKRUN_TOOLS_RACKRUN_COMMAND_H_

#include <string>
#include <vector>

namespace rackrun::cli {

using Args = std::vector<std::string>;

// rackrun plan: replay load traces or generated loads through balancing policies.
int PlanCommand(const Args& args);

// rackrun data: tokenize text (files, folders, JSON Lines) into Megatron datasets; `rackrun
// data tokenizer --train` trains a SentencePiece model.
int DataCommand(const Args& args);

// rackrun export / import: a checkpoint's weights as safetensors + config.json, and back.
int ExportCommand(const Args& args);
int ImportCommand(const Args& args);

// rackrun train: run a training job from a JobSpec file in this process.
int TrainCommand(const Args& args);

// The job client (client.h): submit_command.cc, watch_command.cc, job_commands.cc.
// rackrun submit: validate a JobSpec file here, queue it on the coordinator.
int SubmitCommand(const Args& args);
// rackrun watch: follow a job to its end; exits 0 SUCCEEDED, 1 FAILED, 2 CANCELLED,
// 3 no outcome.
int WatchCommand(const Args& args);
// rackrun status / cancel / list / workers.
int StatusCommand(const Args& args);
int CancelCommand(const Args& args);
int ListCommand(const Args& args);
int WorkersCommand(const Args& args);

}  // namespace rackrun::cli

#endif  // RACKRUN_TOOLS_RACKRUN_COMMAND_H_
