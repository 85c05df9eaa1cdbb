#include "rpc/liveness.h"

#include <algorithm>

namespace rackrun::rpc {

LivenessTimings LivenessFor(std::chrono::milliseconds interval, std::chrono::milliseconds timeout) {
  using std::chrono::milliseconds;
  LivenessTimings t;
  t.interval = std::max(interval, milliseconds(1));
  t.timeout = std::max(timeout, milliseconds(1));
  t.heartbeat_deadline = std::max(t.interval, t.timeout / 4);
  t.retry_period = std::max(t.interval, t.heartbeat_deadline);
  t.late_after = t.interval + t.retry_period;
  t.keepalive_timeout = std::max(milliseconds(20000), 2 * t.timeout + t.interval);
  t.initial_reconnect_backoff = std::min(milliseconds(100), t.interval);
  t.max_reconnect_backoff = std::max(t.initial_reconnect_backoff, t.heartbeat_deadline);
  t.survivable_cut = std::max(milliseconds(0), t.timeout - t.interval - t.retry_period);
  return t;
}

}  // namespace rackrun::rpc
