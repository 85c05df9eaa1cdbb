#include "comm/channel_factory.h"

#include "absl/strings/str_cat.h"
#include "base/string_view.h"
#include "comm/gloo_channel.h"
#include "comm/ucx_channel.h"
#ifdef RACKRUN_HAVE_NCCL
#include "comm/nccl_channel.h"
#endif

namespace rackrun::comm {

bool ChannelBuilt(ChannelKind kind) {
  switch (kind) {
    case ChannelKind::kUcx:
    case ChannelKind::kGloo:
      return true;
    case ChannelKind::kNccl:
#ifdef RACKRUN_HAVE_NCCL
      return true;
#else
      return false;
#endif
  }
  return false;
}

absl::StatusOr<std::unique_ptr<DataChannel>> CreateChannel(std::string_view name,
                                                           RendezvousStore& store,
                                                           const ChannelSetup& setup) {
  const ChannelTraits* traits = FindChannel(ChannelOrDefault(name));
  if (traits == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("resources.channel: unknown data channel '",
                                                   base::AsAbsl(name), "'; choose ",
                                                   ChannelChoices()));
  }
  switch (traits->kind) {
    case ChannelKind::kUcx: {
      UcxChannelOptions o;
      o.channel = setup.channel;
      o.address = setup.address;
      o.label = setup.label;
      return CreateUcxChannel(store, setup.prefix, setup.rank, setup.size, o);
    }
    case ChannelKind::kGloo: {
      GlooChannelOptions o;
      o.channel = setup.channel;
      if (!setup.address.empty()) o.address = setup.address;
      o.label = setup.label;
      return CreateGlooChannel(store, setup.prefix, setup.rank, setup.size, o);
    }
    case ChannelKind::kNccl: {
#ifdef RACKRUN_HAVE_NCCL
      NcclChannelOptions o;
      o.channel = setup.channel;
      o.device = setup.device;
      o.host_buffers = setup.host_buffers;
      return CreateNcclChannel(store, setup.prefix, setup.rank, setup.size, o);
#else
      break;
#endif
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      setup.label.empty() ? "this process" : setup.label, " was built without the ",
      base::AsAbsl(traits->name), " data channel (CUDA or NCCL was not found at build time)"));
}

}  // namespace rackrun::comm
