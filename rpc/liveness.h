// How the control plane rides out a short network cut: every timing of a worker's calls to
// its coordinator and of the gRPC connections at both ends, derived from the coordinator's
// heartbeat interval I (--heartbeat-interval-ms) and heartbeat timeout T
// (--heartbeat-timeout-ms), and the longest cut those timings survive. One derivation, used
// by the worker (worker/connection.h, worker.cc's heartbeat loop, the rendezvous client),
// by the coordinator (its server's keepalive, the failure rules' "late" rank) and by the
// tests that cut links (tests/netns), so the bound in docs/failure-model.md is computed
// from the same figures the daemons use.
//
// Why these timings: a TCP connection that had unacknowledged data when a link went down
// retransmits with an exponentially growing timeout (Linux: 200 ms, 400, 800, 1600 ...),
// so after a cut of C seconds its next retransmission may come up to about C + 0.2 s after
// the link is back, and everything queued on that connection (all HTTP/2 streams of a gRPC
// channel) waits for it: a 1.5 s cut cost 3 s of heartbeat silence (issue 37). So:
// - a heartbeat carries a deadline D well below T, and one that misses it (or finds the
//   coordinator unavailable) makes the worker's later calls go over a new TCP connection
//   (a renewed channel), tried at once or after the interval, whichever is later (P); a
//   new connection's SYN has no backoff history, so the first attempt after the link is
//   back gets through;
// - the connections' keepalive timeout K (which gRPC also sets as TCP_USER_TIMEOUT: data
//   unacknowledged that long aborts the connection) is longer than any stall a survivable
//   cut leaves behind (at most 2C + 0.2 s < 2T), and than the stall of several such cuts
//   in a row (a flapping link: a retransmission after one cut can fall into the next, and
//   the backoff goes on; 6.2 s was too short for four cuts of 0.8 - 1.6 s a second apart),
//   so neither end drops a long-lived stream (the worker's Assignments stream, which keeps
//   a connection of its own) for cuts the heartbeats survive: a dropped stream would be
//   read as a process exit. K = max(20 s, 2T + I): 20 s is gRPC's own default, and lets
//   the retransmissions at 0.2, 0.6, 1.4, 3.0, 6.2 and 12.6 s all fall into cuts first.
//
// The bound: a cut of C ms of the worker's or the coordinator's link costs at most
// I + C + P + e ms of heartbeat silence (the last heartbeat before it came up to I before
// the cut; the first attempt that starts after the link is back starts within P of it;
// e: one TCP and TLS handshake and the call, milliseconds on a LAN), so it is survived
// when C <= T - I - P - e: survivable_cut below (e left out). T <= I + P leaves no cut
// survivable (survivable_cut 0).
//
// Thread safety: pure functions and values.
#ifndef RACKRUN_RPC_LIVENESS_H_
#define RACKRUN_RPC_LIVENESS_H_

#include <chrono>

namespace rackrun::rpc {

struct LivenessTimings {
  std::chrono::milliseconds interval{1000};  // I: how often a worker heartbeats
  std::chrono::milliseconds timeout{5000};   // T: a worker silent this long is lost
  // D = max(I, T/4): the deadline of one heartbeat; the deadline of one slice of the
  // rendezvous client's calls (a slice that misses it is sent again over the channel of
  // the moment).
  std::chrono::milliseconds heartbeat_deadline{1250};
  // P = max(I, D): from one heartbeat attempt's start to the next's when it missed.
  std::chrono::milliseconds retry_period{1250};
  // F = I + P: the longest gap between two heartbeats of a worker whose link is fine but
  // whose one heartbeat missed its deadline. A rank whose last heartbeat is older than
  // this (but not older than T) is late: the coordinator's hang rules do not judge it by
  // its last report (coordinator/failure_detector.h).
  std::chrono::milliseconds late_after{2250};
  // gRPC keepalive: a ping after this long without data (10 s: twice the 5 s the
  // coordinator permits, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, since a
  // faster ping gets the connection closed with GOAWAY too_many_pings) ...
  std::chrono::milliseconds keepalive_time{10000};
  // ... K = max(20 s, 2T + I) without its ack (or any data unacknowledged this long: gRPC
  // sets TCP_USER_TIMEOUT to it) drops the connection.
  std::chrono::milliseconds keepalive_timeout{20000};
  // Reconnect backoff of a channel whose connection failed: from min(100 ms, I) up to D,
  // so that a reconnecting channel tries at least once per heartbeat deadline.
  std::chrono::milliseconds initial_reconnect_backoff{100};
  std::chrono::milliseconds max_reconnect_backoff{1250};
  // B = T - I - P (0 when negative): the longest cut of a link that costs no heartbeat
  // timeout (see the header comment; less the handshake time e).
  std::chrono::milliseconds survivable_cut{2750};
};

// The timings for a coordinator with heartbeat interval `interval` and timeout `timeout`
// (both positive; the coordinator refuses a timeout not above the interval).
LivenessTimings LivenessFor(std::chrono::milliseconds interval, std::chrono::milliseconds timeout);

}  // namespace rackrun::rpc

#endif  // RACKRUN_RPC_LIVENESS_H_
