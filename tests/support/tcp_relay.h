// TcpRelay: a TCP relay on loopback for fault tests. It listens on an ephemeral port of
// 127.0.0.1 and forwards each accepted connection to 127.0.0.1:`target_port`, both ways,
// until either side closes it. FreezeDownstream(n) stops forwarding toward the client on
// the n-th accepted connection (0-based) without closing it: the client's bytes still go up,
// the server's wait in the relay (and then in the server's send buffer), and the client's
// TCP sees no error: a connection stuck as one is when its link drops data and TCP
// retransmits into it. Connections accepted later are forwarded as usual.
//
// One thread polls every socket; writes block (loopback, peers that read). Test-only.
#ifndef RACKRUN_TESTS_SUPPORT_TCP_RELAY_H_
#define RACKRUN_TESTS_SUPPORT_TCP_RELAY_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

namespace rackrun::testing {

class TcpRelay {
 public:
  explicit TcpRelay(int target_port) : target_port_(target_port) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = Loopback(0);
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        ::listen(listener_, 16) != 0) {
      throw std::runtime_error("TcpRelay: cannot listen on 127.0.0.1");
    }
    socklen_t len = sizeof(a);
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    if (::pipe2(wake_, O_CLOEXEC) != 0) throw std::runtime_error("TcpRelay: pipe2");
    thread_ = std::thread([this] { Loop(); });
  }
  ~TcpRelay() {
    stop_ = true;
    (void)::write(wake_[1], "x", 1);
    thread_.join();
    for (const Pair& p : pairs_) {
      ::close(p.client);
      ::close(p.server);
    }
    ::close(listener_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }
  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;

  int port() const { return port_; }
  // Connections accepted so far.
  int accepted() const { return accepted_; }
  // Connections that have carried bytes toward the client (for gRPC: the server's SETTINGS
  // frame, so the client's connection is ready).
  int answered() const { return answered_; }
  void FreezeDownstream(int connection) {
    std::lock_guard<std::mutex> lock(mu_);
    frozen_.insert(connection);
  }

 private:
  struct Pair {
    int index, client, server;
    bool answered = false;
  };

  static sockaddr_in Loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
  }

  bool Frozen(int index) {
    std::lock_guard<std::mutex> lock(mu_);
    return frozen_.count(index) > 0;
  }

  // Copies what `from` has into `to`; false when `from` closed or either failed.
  static bool Forward(int from, int to) {
    char buf[16384];
    const ssize_t n = ::read(from, buf, sizeof(buf));
    if (n <= 0) return false;
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = ::send(to, buf + done, static_cast<size_t>(n - done), MSG_NOSIGNAL);
      if (w <= 0) return false;
      done += w;
    }
    return true;
  }

  void Accept() {
    const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) return;
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = Loopback(target_port_);
    if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(client);
      if (server >= 0) ::close(server);
      return;
    }
    pairs_.push_back(Pair{accepted_++, client, server, false});
  }

  void Loop() {
    while (!stop_) {
      std::vector<pollfd> fds = {{wake_[0], POLLIN, 0}, {listener_, POLLIN, 0}};
      for (const Pair& p : pairs_) {
        fds.push_back({p.client, POLLIN, 0});
        // A frozen connection's server side is not read: its bytes stay there.
        fds.push_back({p.server, static_cast<short>(Frozen(p.index) ? 0 : POLLIN), 0});
      }
      if (::poll(fds.data(), fds.size(), 100) < 0 && errno != EINTR) return;
      if (fds[1].revents & POLLIN) Accept();
      std::vector<Pair> open;
      for (size_t i = 0; i < fds.size() - 2 && i / 2 < pairs_.size(); i += 2) {
        Pair& p = pairs_[i / 2];
        const short up = fds[2 + i].revents, down = fds[3 + i].revents;
        bool ok = true;
        if (up & (POLLIN | POLLHUP | POLLERR)) ok = Forward(p.client, p.server);
        if (ok && !Frozen(p.index) && (down & (POLLIN | POLLHUP | POLLERR))) {
          ok = Forward(p.server, p.client);
          if (ok && !p.answered) {
            p.answered = true;
            ++answered_;
          }
        }
        if (ok) {
          open.push_back(p);
        } else {
          ::close(p.client);
          ::close(p.server);
        }
      }
      // Pairs accepted in this round (not polled yet) stay.
      for (size_t i = (fds.size() - 2) / 2; i < pairs_.size(); ++i) open.push_back(pairs_[i]);
      pairs_ = std::move(open);
    }
  }

  const int target_port_;
  int listener_ = -1;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::atomic<int> answered_{0};
  std::mutex mu_;
  std::set<int> frozen_;
  std::vector<Pair> pairs_;  // the loop's thread only (and the destructor after it)
  std::thread thread_;
};

}  // namespace rackrun::testing

#endif  // RACKRUN_TESTS_SUPPORT_TCP_RELAY_H_
