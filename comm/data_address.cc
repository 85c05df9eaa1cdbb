#include "comm/data_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rackrun::comm {

bool Routable(const std::string& address) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(address.c_str(), "9", &hints, &found) != 0 || found == nullptr) return true;
  bool routable = true;
  const int fd = ::socket(found->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    if (::connect(fd, found->ai_addr, found->ai_addrlen) != 0) {
      routable = errno != ENETUNREACH && errno != EHOSTUNREACH;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return routable;
}

std::string Announced(const std::string& address, const std::string& label) {
  return label.empty() ? address : absl::StrCat(address, " (", label, ")");
}

std::string NoRoute(const std::vector<std::string>& unroutable) {
  return absl::StrCat("this host has no route to ", absl::StrJoin(unroutable, ", "),
                      ": that rank's --data-address is not reachable from its peers");
}

bool IsWildcardAddress(const std::string& address) {
  std::string bare = address;
  if (bare.size() >= 2 && bare.front() == '[' && bare.back() == ']')
    bare = bare.substr(1, bare.size() - 2);
  in_addr v4{};
  in6_addr v6{};
  if (::inet_pton(AF_INET, bare.c_str(), &v4) == 1) return v4.s_addr == htonl(INADDR_ANY);
  if (::inet_pton(AF_INET6, bare.c_str(), &v6) == 1) return IN6_IS_ADDR_UNSPECIFIED(&v6);
  return false;
}

absl::StatusOr<UcxInterface> UcxInterfaceOf(const std::string& address) {
  in_addr v4{};
  in6_addr v6{};
  const bool is_v4 = inet_pton(AF_INET, address.c_str(), &v4) == 1;
  const bool is_v6 = !is_v4 && inet_pton(AF_INET6, address.c_str(), &v6) == 1;
  if (!is_v4 && !is_v6) return UcxInterface{};
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return absl::UnavailableError(absl::StrCat("getifaddrs: ", std::strerror(errno)));
  }
  UcxInterface found;
  for (ifaddrs* i = list; i != nullptr && found.name.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    if (is_v4 && i->ifa_addr->sa_family == AF_INET) {
      sockaddr_in in{};
      std::memcpy(&in, i->ifa_addr, sizeof(in));
      // The loopback interface holds its whole subnet (Linux answers 127.0.0.0/8 on lo, so
      // the daemon tests' 127.0.0.2, 127.0.0.3 are lo's); any other interface its own address.
      bool holds = in.sin_addr.s_addr == v4.s_addr;
      if (!holds && (i->ifa_flags & IFF_LOOPBACK) != 0 && i->ifa_netmask != nullptr) {
        sockaddr_in mask{};
        std::memcpy(&mask, i->ifa_netmask, sizeof(mask));
        holds = (in.sin_addr.s_addr & mask.sin_addr.s_addr) == (v4.s_addr & mask.sin_addr.s_addr);
      }
      if (holds) found.name = i->ifa_name;
    } else if (is_v6 && i->ifa_addr->sa_family == AF_INET6) {
      sockaddr_in6 in{};
      std::memcpy(&in, i->ifa_addr, sizeof(in));
      if (std::memcmp(&in.sin6_addr, &v6, sizeof(v6)) == 0) found.name = i->ifa_name;
    }
  }
  // The interface's first address of the family: the one UCX's TCP transport takes.
  const int family = is_v4 ? AF_INET : AF_INET6;
  for (ifaddrs* i = list; i != nullptr && !found.name.empty() && found.address.empty();
       i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != family || found.name != i->ifa_name) {
      continue;
    }
    char text[INET6_ADDRSTRLEN] = {};
    const void* raw =
        is_v4
            ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr)
            : static_cast<const void*>(
                  &reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr);
    if (inet_ntop(family, raw, text, sizeof(text)) != nullptr) found.address = text;
  }
  freeifaddrs(list);
  if (found.name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data address ", address,
        " is not an address of this machine's interfaces; give the worker a --data-address "
        "it owns, or a host name"));
  }
  return found;
}

}  // namespace rackrun::comm
