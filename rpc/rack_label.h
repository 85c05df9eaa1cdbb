// The rack label a worker reports (--rack, RACKRUN_RACK; RegisterRequest.rack): the name of
// the host group (a rack's scale-up domain) it sits in. The coordinator's scheduler packs the
// ranks of one expert-parallel domain onto workers with one label (coordinator/scheduler.h).
// One rule, checked by the worker when it parses its flag and by the coordinator when a
// worker registers: empty (no label), or 1 to 63 of letters, digits, '.', '_', '-'.
//
// Thread safety: pure function.
#ifndef RACKRUN_RPC_RACK_LABEL_H_
#define RACKRUN_RPC_RACK_LABEL_H_

#include <string>

#include "absl/status/status.h"

namespace rackrun::rpc {

inline constexpr int kMaxRackLabelLength = 63;

// InvalidArgument saying what is wrong and what is allowed otherwise; the caller puts the
// flag or field in front ("--rack: ", "rack: ").
absl::Status CheckRackLabel(const std::string& label);

}  // namespace rackrun::rpc

#endif  // RACKRUN_RPC_RACK_LABEL_H_
