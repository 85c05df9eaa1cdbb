// Phase: what a worker says it is doing in every heartbeat (HeartbeatRequest.phase), the
// one mapping between the phase names on the wire and the enum the worker and the
// coordinator use. The failure detector judges a rank by its phase (docs/design.md 7.5,
// coordinator/failure_detector.h); the names are also the `phase` of a Failure, of an
// AttemptResult, of ListWorkers and of the worker's metrics.
//
// The trainer's phases carry runtime::TrainPhaseName's names (runtime/trainer.h); the
// worker maps runtime::TrainPhase onto Phase (worker/job_runner.h, WorkerPhase).
//
// Thread safety: pure functions.
#ifndef RACKRUN_RPC_PHASE_H_
#define RACKRUN_RPC_PHASE_H_

#include <string_view>

namespace rackrun::rpc {

enum class Phase : int {
  kIdle = 0,         // "idle": no attempt on this worker (also the trainer outside Run)
  kStarting,         // "starting": attempt received; paths, memory check, model, data
  kConnecting,       // "connecting": in the data channel's rendezvous, waiting for peers
  kAgree,            // "agree": the trainer's per-step all-reduce deciding whether to stop
  kData,             // "data": loading the next microbatch
  kForwardBackward,  // "forward_backward": the model's forward and backward
  kReduce,           // "reduce": all-reducing dense gradients, the loss and the norm
  kOptimizer,        // "optimizer": the AdamW step
  kEvaluate,         // "evaluate": validation
  kCheckpoint,       // "checkpoint": writing (or gathering shards for) a checkpoint
  kCollective,       // "collective": blocked in a data-channel collective
  kReporting,        // "reporting": training over, pending progress and the result on the way
  kResuming,         // "resuming": only in a failed attempt's result (resuming from the
                     // checkpoint failed); the heartbeat says "starting" meanwhile
  kOther,            // a name not above (another version's phase): judged as a training phase
};

// The wire name of `phase` ("idle", "starting", ...); kOther: "other".
const char* PhaseName(Phase phase);

// The phase named `name`: the empty name (a worker that said nothing yet) is kIdle, a name
// not in the list kOther.
Phase ParsePhase(std::string_view name);

}  // namespace rackrun::rpc

#endif  // RACKRUN_RPC_PHASE_H_
