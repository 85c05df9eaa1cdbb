#include "rpc/phase.h"

namespace rackrun::rpc {

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kIdle:
      return "idle";
    case Phase::kStarting:
      return "starting";
    case Phase::kConnecting:
      return "connecting";
    case Phase::kAgree:
      return "agree";
    case Phase::kData:
      return "data";
    case Phase::kForwardBackward:
      return "forward_backward";
    case Phase::kReduce:
      return "reduce";
    case Phase::kOptimizer:
      return "optimizer";
    case Phase::kEvaluate:
      return "evaluate";
    case Phase::kCheckpoint:
      return "checkpoint";
    case Phase::kCollective:
      return "collective";
    case Phase::kReporting:
      return "reporting";
    case Phase::kResuming:
      return "resuming";
    case Phase::kOther:
      return "other";
  }
  return "other";
}

Phase ParsePhase(std::string_view name) {
  if (name.empty()) return Phase::kIdle;
  // Every phase before kOther has a name of its own.
  for (int i = 0; i < static_cast<int>(Phase::kOther); ++i) {
    if (name == PhaseName(static_cast<Phase>(i))) return static_cast<Phase>(i);
  }
  return Phase::kOther;
}

}  // namespace rackrun::rpc
