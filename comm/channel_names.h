// The data channels a job chooses by name (resources.channel): the one list. The spec
// module validates resources.channel against it, the coordinator's scheduler matches jobs
// to the workers that offer it, the worker offers what it can build, and CreateChannel
// (channel_factory.h) builds it. These are the channels the worker daemons build per
// attempt from the coordinator's rendezvous store; MPI (the direct launch's) and the
// in-process channel (tests) are made directly, not by name.
//
// Header-only and free of every backend's library (target rackrun_comm_names), so the
// spec module and the coordinator use it without linking comm.
//
// Adding a channel: its backend beside the others (comm/<name>_channel.{h,cc}), a row in
// kChannels, and its case in CreateChannel (channel_factory.cc).
#ifndef RACKRUN_COMM_CHANNEL_NAMES_H_
#define RACKRUN_COMM_CHANNEL_NAMES_H_

#include <string>
#include <string_view>

namespace rackrun::comm {

enum class ChannelKind { kUcx, kGloo, kNccl };

struct ChannelTraits {
  ChannelKind kind;
  std::string_view name;
  // Where the ranks' buffers live: "CPU" or "GPU" (in spec errors: "gloo (CPU)").
  std::string_view memory;
  // Offered only by a worker with a CUDA device (--device cuda:N).
  bool needs_gpu = false;
};

// Every channel a job may choose, the default first.
inline constexpr ChannelTraits kChannels[] = {
    {ChannelKind::kUcx, "ucx", "CPU", false},
    {ChannelKind::kGloo, "gloo", "CPU", false},
    {ChannelKind::kNccl, "nccl", "GPU", true},
};

// resources.channel of a spec that names none.
inline constexpr std::string_view kDefaultChannel = kChannels[0].name;

// The traits of the channel named `name`; null when there is none (also for "").
constexpr const ChannelTraits* FindChannel(std::string_view name) {
  for (const ChannelTraits& c : kChannels) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

// `name`, or the default channel's name when it is empty (a spec or bootstrap that names
// none).
constexpr std::string_view ChannelOrDefault(std::string_view name) {
  return name.empty() ? kDefaultChannel : name;
}

// The choices as a spec error lists them: "ucx (CPU, the default), gloo (CPU) or nccl (GPU)".
inline std::string ChannelChoices() {
  std::string out;
  constexpr size_t n = sizeof(kChannels) / sizeof(kChannels[0]);
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) out += i + 1 == n ? " or " : ", ";
    out.append(kChannels[i].name).append(" (").append(kChannels[i].memory);
    if (i == 0) out += ", the default";
    out += ")";
  }
  return out;
}

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_CHANNEL_NAMES_H_
