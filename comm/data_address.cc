#include "comm/data_address.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

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

}  // namespace rackrun::comm
