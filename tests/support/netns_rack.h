// A rack in a box: N hosts on one machine as Linux network namespaces, for the daemon
// tests across "hosts" (tests/netns). Each host is a namespace `rr<pid>-h<i>` with `lo`
// up and one interface `eth0` holding 198.18.<a>.<i+1>/24; its veth peer `h<i>` is a port
// of the bridge `br0` in the switch namespace `rr<pid>-sw`. Nothing is added to the
// namespace the test runs in but the namespaces themselves (their names in /run/netns).
//
//   rr<pid>-h0 eth0 198.18.a.1 ---- h0 ┐
//   rr<pid>-h1 eth0 198.18.a.2 ---- h1 ├ br0   (rr<pid>-sw)
//   ...                                ┘
//
// Addresses come only from 198.18.0.0/15 (RFC 2544 benchmarking): a = the pid modulo 512
// spread over 198.18.0.0-198.19.255.0, so two test processes use different subnets (and
// their own namespaces, so they could not reach each other anyway).
//
// Faults are made on the switch side (SetLink: `ip link set h<i> down` cuts host i off,
// and its eth0 loses carrier; SetForwarding: the bridge drops everything from and to h<i>
// while every interface stays up, a cut further away; Tc: a qdisc on h<i> shapes what
// host i receives) or inside a host (InHost).
//
// Clean-up is guaranteed: the destructor kills every process inside the namespaces and
// deletes them; a janitor process (started by the constructor, its stdin a pipe only this
// process holds) does the same when this process dies without running the destructor
// (a crash, SIGKILL, a CTest timeout); and the constructor first deletes namespaces
// rr<pid>-* whose pid is not a running process (left by a machine crash).
//
// Needs root with CAP_NET_ADMIN (and CAP_SYS_ADMIN for `ip netns exec`), the `ip` and
// `bridge` commands (iproute2), and a kernel with veth and bridge: Unavailable() says what
// is missing.
// Header-only; not thread-safe.
#ifndef RACKRUN_TESTS_SUPPORT_NETNS_RACK_H_
#define RACKRUN_TESTS_SUPPORT_NETNS_RACK_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

namespace rackrun::testing {

class NetnsRack {
 public:
  // The `ip` and `bridge` commands this harness runs (iproute2).
  static constexpr char kIp[] = "/usr/sbin/ip";
  static constexpr char kBridge[] = "/usr/sbin/bridge";

  // Why this machine cannot make namespaces; "" when it can. Tries one (and deletes it).
  static std::string Unavailable() {
    for (const char* command : {kIp, kBridge}) {
      if (::access(command, X_OK) != 0)
        return std::string(command) + " not found (install iproute2)";
    }
    if (::geteuid() != 0) return "needs root (CAP_NET_ADMIN) to make network namespaces";
    const std::string probe = Prefix() + "probe";
    std::string out;
    const int code = Run(std::string(kIp) + " netns add " + probe + " && " + kIp + " netns exec " +
                             probe + " " + kIp + " link set lo up && " + kIp + " -n " + probe +
                             " link add v0 type veth peer name v1 && " + kIp + " -n " + probe +
                             " link add b0 type bridge",
                         &out);
    Run(std::string(kIp) + " netns del " + probe, nullptr);
    if (code != 0) {
      return "cannot make a network namespace with a veth pair and a bridge (needs root with "
             "CAP_NET_ADMIN and CAP_SYS_ADMIN): " +
             out;
    }
    return "";
  }

  // Makes `hosts` hosts; error() says what failed ("" on success).
  explicit NetnsRack(int hosts) {
    SweepStale();
    StartJanitor();
    const int a = static_cast<int>(::getpid() % 512);
    subnet_ = "198." + std::to_string(18 + a / 256) + "." + std::to_string(a % 256) + ".";
    std::string sw = Switch();
    std::string script = Ip("netns add " + sw) + " && " + Ip("-n " + sw + " link set lo up") +
                         " && " + Ip("-n " + sw + " link add br0 type bridge") + " && " +
                         Ip("-n " + sw + " link set br0 up");
    for (int i = 0; i < hosts; ++i) {
      const std::string ns = Namespace(i), port = Port(i);
      script += " && " + Ip("netns add " + ns) + " && " + Ip("-n " + ns + " link set lo up") +
                " && " +
                Ip("-n " + sw + " link add " + port + " type veth peer name eth0 netns " + ns) +
                " && " + Ip("-n " + sw + " link set " + port + " master br0") + " && " +
                Ip("-n " + sw + " link set " + port + " up") + " && " +
                Ip("-n " + ns + " addr add " + Address(i) + "/24 dev eth0") + " && " +
                Ip("-n " + ns + " link set eth0 up");
    }
    std::string out;
    if (Run(script, &out) != 0) {
      error_ = "making " + std::to_string(hosts) + " network namespaces failed: " + out;
      return;
    }
    hosts_ = hosts;
  }

  ~NetnsRack() {
    Run(CleanupScript(::getpid()), nullptr);
    if (janitor_pipe_ >= 0) ::close(janitor_pipe_);  // the janitor finds nothing left and exits
    if (janitor_ > 0) ::waitpid(janitor_, nullptr, 0);
  }
  NetnsRack(const NetnsRack&) = delete;
  NetnsRack& operator=(const NetnsRack&) = delete;

  const std::string& error() const { return error_; }
  int hosts() const { return hosts_; }

  static std::string Prefix(pid_t pid = ::getpid()) { return "rr" + std::to_string(pid) + "-"; }
  std::string Namespace(int host) const { return Prefix() + "h" + std::to_string(host); }
  std::string Switch() const { return Prefix() + "sw"; }
  // Host i's port on the bridge (in the switch namespace).
  static std::string Port(int host) { return "h" + std::to_string(host); }
  std::string Address(int host) const { return subnet_ + std::to_string(host + 1); }
  // An address in no host's subnet: nothing routes to it.
  std::string UnroutedAddress(int host) const {
    const int a = static_cast<int>(::getpid() % 512) ^ 1;  // a neighbour subnet, unused here
    return "198." + std::to_string(18 + a / 256) + "." + std::to_string(a % 256) + "." +
           std::to_string(host + 1);
  }

  // argv prefix that runs a program on host i.
  std::vector<std::string> Exec(int host) const { return {kIp, "netns", "exec", Namespace(host)}; }
  // The same for a shell command line.
  std::string ExecPrefix(int host) const {
    return std::string(kIp) + " netns exec " + Namespace(host) + " ";
  }

  // Host i's link up or down (its bridge port, so the host's own interface stays up and
  // its processes see no change but silence). True on success.
  bool SetLink(int host, bool up) {
    return Run(Ip("-n " + Switch() + " link set " + Port(host) + (up ? " up" : " down")),
               nullptr) == 0;
  }

  // Host i's traffic dropped by the switch (false: its bridge port's state "disabled") or
  // forwarded again (true). Unlike SetLink, the host's eth0 keeps its carrier (no ARP
  // flush, no local send error): its TCP connections see only loss and retransmit with
  // exponential backoff, as across a cut beyond the host's own cable. True on success.
  bool SetForwarding(int host, bool forward) {
    return Run(std::string(kBridge) + " -n " + Switch() + " link set dev " + Port(host) +
                   " state " + (forward ? "3" : "0"),
               nullptr) == 0;
  }

  // `tc ARGS` in the switch namespace (for qdiscs on a port) or on host i (host >= 0).
  bool Tc(int host, const std::string& args, std::string* out = nullptr) {
    const std::string ns = host < 0 ? Switch() : Namespace(host);
    return Run("/usr/sbin/tc -n " + ns + " " + args, out) == 0;
  }

  // `ip ARGS` inside host i.
  bool InHost(int host, const std::string& ip_args, std::string* out = nullptr) {
    return Run(Ip("-n " + Namespace(host) + " " + ip_args), out) == 0;
  }

  // /bin/sh `command`; its exit status, stdout and stderr into *out when given.
  static int Run(const std::string& command, std::string* out) {
    const std::string full = "(" + command + ") 2>&1";
    FILE* p = ::popen(full.c_str(), "r");
    if (p == nullptr) return -1;
    std::string text;
    char buffer[512];
    for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, p)) > 0;) text.append(buffer, n);
    const int status = ::pclose(p);
    if (out != nullptr) *out = text;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  static std::string Ip(const std::string& args) { return std::string(kIp) + " " + args; }

  // Kills what runs in the namespaces rr<pid>-* and deletes them.
  static std::string CleanupScript(pid_t pid) {
    return "for n in $(" + std::string(kIp) + " netns list | sed -n 's/^\\(" + Prefix(pid) +
           "[^ ]*\\).*/\\1/p'); do " + kIp + " netns pids $n | xargs -r kill -9; " + kIp +
           " netns del $n; done";
  }

  // Deletes namespaces rr<pid>-* of processes that no longer run.
  static void SweepStale() {
    std::string list;
    if (Run(std::string(kIp) + " netns list", &list) != 0) return;
    const std::regex name("^rr([0-9]+)-[^ \n]*", std::regex::multiline);
    std::vector<pid_t> dead;
    for (auto it = std::sregex_iterator(list.begin(), list.end(), name);
         it != std::sregex_iterator(); ++it) {
      const pid_t pid = static_cast<pid_t>(std::stol((*it)[1].str()));
      if (!std::filesystem::exists("/proc/" + std::to_string(pid))) dead.push_back(pid);
    }
    for (const pid_t pid : dead) Run(CleanupScript(pid), nullptr);
  }

  // A shell that waits for end-of-file on a pipe whose only writer is this process, then
  // cleans up after it: its own session, output to /dev/null (so that CTest does not wait
  // for it), no parent-death signal.
  void StartJanitor() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;
    const std::string script = "cat >/dev/null; " + CleanupScript(::getpid());
    janitor_ = ::fork();
    if (janitor_ == 0) {
      ::setsid();
      ::dup2(fds[0], 0);
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      ::dup2(null, 2);
      ::execl("/bin/sh", "sh", "-c", script.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(fds[0]);
    janitor_pipe_ = fds[1];
  }

  std::string subnet_;
  std::string error_;
  int hosts_ = 0;
  pid_t janitor_ = -1;
  int janitor_pipe_ = -1;
};

}  // namespace rackrun::testing

#endif  // RACKRUN_TESTS_SUPPORT_NETNS_RACK_H_
