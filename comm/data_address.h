// What the socket-based data channels (Gloo, UCX) share about a rank's data address: the
// route check made before any connect, how a peer is named in errors, which addresses
// mean every interface, and the interface UCX takes (the worker checks its --data-address
// with the last two at start). Each rank
// announces itself in the rendezvous store as "ADDRESS (LABEL)" (the worker's
// --data-address, and "worker W on host H"); once every rank has joined, a rank checks
// that this host has a route to each peer's address and fails at once naming the peers it
// cannot reach, the same way every time, instead of failing only on the side that happens
// to connect (Gloo) or stalling in UCX's wire-up until a timeout blames someone else.
#ifndef RACKRUN_COMM_DATA_ADDRESS_H_
#define RACKRUN_COMM_DATA_ADDRESS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace rackrun::comm {

// Whether this host has a route to `address` (a name or a numeric address): a UDP
// connect makes the kernel look the route up and sends nothing. True when unknown (a name
// that does not resolve here is left to the connect).
bool Routable(const std::string& address);

// "ADDRESS (LABEL)", or ADDRESS alone for an empty label: how a rank announces itself.
std::string Announced(const std::string& address, const std::string& label);

// "this host has no route to rank 1 at 198.18.0.3 (worker w-2 on host h2), ...: that
// rank's --data-address is not reachable from its peers"; `unroutable` holds
// "rank R at ANNOUNCED" lines.
std::string NoRoute(const std::vector<std::string>& unroutable);

// True for an address that means "every interface" (0.0.0.0, ::, [::]): nothing a peer can
// connect to, and a listener on it would take connections from every network.
bool IsWildcardAddress(const std::string& address);

// The interface that holds the data address `address` (a numeric IP address) and the
// address UCX's TCP transport takes on it: the interface's first address of that family,
// as getifaddrs lists them (UCX 1.13's ucs_netif_get_addr). Both empty for an empty
// address or a host name; InvalidArgument for an IP address none of this machine's
// interfaces has. A loopback address belongs to lo (Linux answers all of 127.0.0.0/8
// there).
struct UcxInterface {
  std::string name;     // "eth0"
  std::string address;  // "198.18.0.3"
};
absl::StatusOr<UcxInterface> UcxInterfaceOf(const std::string& address);

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_DATA_ADDRESS_H_
