// The TCP sockets a process listens on, read from /proc (what `ss -ltnp` shows), for tests
// that check what a daemon or a channel exposes. Header-only; Linux.
#ifndef RACKRUN_TESTS_SUPPORT_LISTENING_SOCKETS_H_
#define RACKRUN_TESTS_SUPPORT_LISTENING_SOCKETS_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

namespace rackrun::testing {

// Process `pid`'s listening TCP sockets (0 = this process), socket inode -> "ADDR:PORT".
// IPv4 addresses as dotted quads; IPv6 ones as /proc/net/tcp6 writes them (32 hex digits).
inline std::map<std::string, std::string> ListeningSockets(pid_t pid = 0) {
  const std::filesystem::path proc = pid == 0
                                         ? std::filesystem::path("/proc/self")
                                         : std::filesystem::path("/proc") / std::to_string(pid);
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator(proc / "fd", ec)) {
    std::error_code link_ec;
    const std::string target = std::filesystem::read_symlink(fd.path(), link_ec).string();
    if (!link_ec && target.rfind("socket:[", 0) == 0) {
      inodes.insert(target.substr(8, target.size() - 9));
    }
  }
  std::map<std::string, std::string> out;
  for (const char* table : {"net/tcp", "net/tcp6"}) {
    std::ifstream in(proc / table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
      std::istringstream fields(line);
      std::string sl, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> sl >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state != "0A" || inodes.count(inode) == 0) continue;  // 0A: LISTEN
      const std::string hex = local.substr(0, local.find(':'));
      const int port = std::stoi(local.substr(local.find(':') + 1), nullptr, 16);
      std::string address = hex;
      if (hex.size() == 8) {  // IPv4: the 32-bit value as the machine stores it
        in_addr a{};
        a.s_addr = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
        char text[INET_ADDRSTRLEN] = {};
        inet_ntop(AF_INET, &a, text, sizeof text);
        address = text;
      }
      out[inode] = address + ":" + std::to_string(port);
    }
  }
  return out;
}

// The address part of "ADDR:PORT".
inline std::string AddressOf(const std::string& address_port) {
  return address_port.substr(0, address_port.rfind(':'));
}

}  // namespace rackrun::testing

#endif  // RACKRUN_TESTS_SUPPORT_LISTENING_SOCKETS_H_
