#include "coordinator/workers.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rackrun::coordinator {

using rackrun::v1::Failure;
using rackrun::v1::FailureKind;

namespace {
// A rank in phase "reporting" (training over, result on the way) is hung only after this
// many hang timeouts (Detect).
constexpr int64_t kReportingTimeouts = 4;
}  // namespace

Workers::Workers(Clock clock, Options options, std::function<absl::StatusOr<int64_t>()> next_number)
    : clock_(std::move(clock)), options_(options), next_number_(std::move(next_number)) {}

Workers::Info* Workers::Find(const std::string& id) {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::string> Workers::Register(const rackrun::v1::RegisterRequest& req) {
  if (req.host().empty()) return absl::InvalidArgumentError("host: required (the worker's host name)");
  std::string id = req.worker_id();
  if (id.empty()) {
    absl::StatusOr<int64_t> n = next_number_();
    if (!n.ok()) return n.status();
    id = absl::StrCat("w-", *n);
  }
  Lock lock(mu_);
  if (shutdown_) return absl::UnavailableError("the coordinator is shutting down");
  const int64_t now = clock_();
  Info& w = workers_[id];
  const int64_t generation = w.generation + 1;  // a stream of the old registration ends
  w = Info();
  w.generation = generation;
  w.w.set_id(id);
  w.w.set_host(req.host());
  w.w.set_pid(req.pid());
  w.w.set_launcher_rank(req.launcher_rank());
  w.w.set_device(req.device());
  for (const std::string& c : req.channels()) w.w.add_channels(c);
  w.w.set_state(rackrun::v1::IDLE);
  w.w.set_registered_unix_ms(now);
  w.data_address = req.data_address();
  w.w.set_metrics_address(req.metrics_address());
  w.last_heartbeat_ms = now;
  cv_.notify_all();
  return id;
}

absl::Status Workers::Heartbeat(const rackrun::v1::HeartbeatRequest& req) {
  Lock lock(mu_);
  Info* w = Find(req.worker_id());
  if (w == nullptr || w->w.state() == rackrun::v1::LOST || w->w.state() == rackrun::v1::GONE) {
    return absl::NotFoundError(absl::StrCat("worker '", req.worker_id(),
                                            "' is not registered; register again"));
  }
  const int64_t now = clock_();
  w->last_heartbeat_ms = now;
  w->w.set_step(req.step());
  w->w.set_phase(req.phase());
  w->w.set_step_time_s(req.step_time_s());
  w->phase_age_ms = req.phase_age_ms();
  w->entered = req.collectives_entered();
  w->completed = req.collectives_completed();
  if (w->entered > w->completed) {
    if (w->blocked_n != w->entered) {
      w->blocked_n = w->entered;
      w->blocked_since_ms = now;
    }
  } else {
    w->blocked_n = 0;
  }
  return absl::OkStatus();
}

absl::Status Workers::Deregister(const std::string& worker_id) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w == nullptr) return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' is not registered"));
  w->w.set_state(rackrun::v1::GONE);
  ++w->generation;
  w->stream_open = false;
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Workers::OpenStream(const std::string& worker_id) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w == nullptr || w->w.state() == rackrun::v1::LOST || w->w.state() == rackrun::v1::GONE) {
    return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' is not registered; register first"));
  }
  ++w->generation;
  w->stream_open = true;
  w->stream_seen = true;
  cv_.notify_all();
  return w->generation;
}

absl::StatusOr<std::optional<rackrun::v1::Assignment>> Workers::NextAssignment(
    const std::string& worker_id, int64_t generation, absl::Duration max_wait) {
  Lock lock(mu_);
  const absl::Time deadline = absl::Now() + max_wait;
  while (true) {
    Info* w = Find(worker_id);
    if (shutdown_) return absl::UnavailableError("the coordinator is shutting down");
    if (w == nullptr || w->generation != generation) {
      return absl::CancelledError("a newer registration or stream replaced this stream");
    }
    if (!w->outbox.empty()) {
      rackrun::v1::Assignment a = std::move(w->outbox.front());
      w->outbox.pop_front();
      return std::optional<rackrun::v1::Assignment>(std::move(a));
    }
    if (WaitUntil(cv_, lock, deadline)) return std::optional<rackrun::v1::Assignment>();
  }
}

void Workers::CloseStream(const std::string& worker_id, int64_t generation) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w != nullptr && w->generation == generation) w->stream_open = false;
}

void Workers::Push(const std::string& worker_id, const rackrun::v1::Assignment& a) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w == nullptr || w->w.state() == rackrun::v1::GONE) return;
  w->outbox.push_back(a);
  cv_.notify_all();
}

void Workers::SetBusy(const std::string& worker_id, const std::string& job_id, int attempt, int rank) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w == nullptr) return;
  w->w.set_state(rackrun::v1::BUSY);
  w->w.set_job_id(job_id);
  w->w.set_rank(rank);
  w->attempt = attempt;
  w->blocked_n = 0;
  w->entered = w->completed = 0;
  w->phase_age_ms = 0;
  w->w.set_phase("starting");
  w->last_heartbeat_ms = std::max(w->last_heartbeat_ms, clock_());
}

void Workers::SetIdle(const std::string& worker_id, const std::string& job_id) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w == nullptr || (!job_id.empty() && w->w.job_id() != job_id)) return;
  if (w->w.state() == rackrun::v1::BUSY) w->w.set_state(rackrun::v1::IDLE);
  w->w.clear_job_id();
  w->w.set_rank(0);
  w->attempt = 0;
  w->blocked_n = 0;
  w->w.set_phase("idle");
}

std::vector<IdleWorker> Workers::Idle() const {
  Lock lock(mu_);
  std::vector<IdleWorker> out;
  for (const auto& [id, w] : workers_) {
    if (w.w.state() != rackrun::v1::IDLE || !w.stream_open) continue;
    IdleWorker i{id, w.w.host(), w.w.pid(), w.w.launcher_rank(), w.data_address, {}};
    i.channels.assign(w.w.channels().begin(), w.w.channels().end());
    out.push_back(std::move(i));
  }
  return out;
}

absl::StatusOr<rackrun::v1::RankPlacement> Workers::Placement(const std::string& worker_id) const {
  Lock lock(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' is not registered"));
  rackrun::v1::RankPlacement p;
  p.set_worker_id(worker_id);
  p.set_host(it->second.w.host());
  p.set_pid(it->second.w.pid());
  return p;
}

Failure Workers::FailureOf(const Info& w, FailureKind kind, std::string message) const {
  Failure f;
  f.set_kind(kind);
  f.set_rank(w.w.rank());
  f.set_worker_id(w.w.id());
  f.set_host(w.w.host());
  f.set_pid(w.w.pid());
  f.set_phase(w.w.phase());
  f.set_step(w.w.step());
  f.set_message(std::move(message));
  f.set_time_unix_ms(clock_());
  return f;
}

std::vector<Finding> Workers::Detect() {
  Lock lock(mu_);
  const int64_t now = clock_();
  std::vector<Finding> out;
  auto report = [&](const Info& w, Failure f) {
    const auto key = std::make_pair(w.w.job_id(), w.attempt);
    if (reported_[key]) return;
    reported_[key] = true;
    out.push_back({w.w.job_id(), w.attempt, std::move(f)});
  };
  auto silent = [&](const Info& w) { return now - w.last_heartbeat_ms > options_.heartbeat_timeout_ms; };
  const double secs = 1000.0;

  // Closed streams: the process is gone.
  for (auto& [id, w] : workers_) {
    const auto s = w.w.state();
    if (s == rackrun::v1::LOST || s == rackrun::v1::GONE) continue;
    if (w.stream_seen && !w.stream_open) {
      w.w.set_state(rackrun::v1::LOST);
      if (!w.w.job_id().empty()) {
        report(w, FailureOf(w, rackrun::v1::WORKER_LOST,
                            "its connection to the coordinator closed (the process exited or was killed)"));
      }
    }
  }

  // Per attempt: the collective rule, then silence, then the phase rule.
  std::map<std::pair<std::string, int>, std::vector<Info*>> attempts;
  for (auto& [id, w] : workers_) {
    if (w.w.state() == rackrun::v1::BUSY && !w.w.job_id().empty()) {
      attempts[{w.w.job_id(), w.attempt}].push_back(&w);
    } else if (w.w.state() == rackrun::v1::IDLE && silent(w)) {
      w.w.set_state(rackrun::v1::LOST);
    }
  }
  for (auto& [key, ranks] : attempts) {
    if (reported_[key]) continue;
    std::sort(ranks.begin(), ranks.end(), [](const Info* a, const Info* b) { return a->w.rank() < b->w.rank(); });
    int64_t n = 0;  // the collective the peers wait in
    int64_t longest_ms = 0;
    bool any_blocked = false;
    std::vector<int> waiting;
    for (const Info* w : ranks) {
      if (silent(*w) || w->blocked_n == 0) continue;
      any_blocked = true;
      const int64_t blocked_ms = now - w->blocked_since_ms;
      if (blocked_ms > options_.hang_timeout_ms) {
        n = std::max(n, w->blocked_n);
        longest_ms = std::max(longest_ms, blocked_ms);
        waiting.push_back(w->w.rank());
      }
    }
    if (n > 0) {
      const Info* culprit = nullptr;
      std::string why;
      for (const Info* w : ranks) {
        if (silent(*w) && w->stream_open) {
          culprit = w;
          why = absl::StrCat("its heartbeats stopped ", (now - w->last_heartbeat_ms) / secs,
                             " s ago while its connection stays open (stopped or stuck process)");
          break;
        }
      }
      if (culprit == nullptr) {
        for (const Info* w : ranks) {
          if (w->entered < n && (culprit == nullptr || w->entered < culprit->entered)) culprit = w;
        }
        if (culprit != nullptr) why = absl::StrCat("it has entered only ", culprit->entered, " collectives");
      }
      // Every rank has entered collective n and none is silent yet. A rank stopped inside
      // the collective (SIGSTOP after it entered) looks the same until its heartbeats are
      // overdue, so wait for heartbeat_timeout more before naming no rank: by then a
      // stopped rank is silent and named above.
      if (culprit == nullptr && longest_ms <= options_.hang_timeout_ms + options_.heartbeat_timeout_ms) {
        continue;
      }
      const std::string peers = absl::StrCat("rank(s) ", absl::StrJoin(waiting, ", "),
                                             " wait in collective ", n, " for ", longest_ms / secs, " s");
      if (culprit != nullptr) {
        report(*culprit, FailureOf(*culprit, rackrun::v1::HANG, absl::StrCat(peers, "; ", why)));
      } else {
        Failure f = FailureOf(*ranks.front(), rackrun::v1::HANG,
                              absl::StrCat(peers, "; every rank is in it (no single rank behind)"));
        f.set_rank(-1);
        f.clear_worker_id();
        f.clear_host();
        f.set_pid(0);
        f.set_phase("collective");
        report(*ranks.front(), f);
      }
      continue;
    }
    bool found = false;
    for (Info* w : ranks) {
      if (silent(*w) && !any_blocked) {
        w->w.set_state(rackrun::v1::LOST);
        report(*w, FailureOf(*w, rackrun::v1::WORKER_LOST,
                             absl::StrCat("no heartbeat for ", (now - w->last_heartbeat_ms) / secs,
                                          " s (heartbeat timeout ", options_.heartbeat_timeout_ms / secs,
                                          " s)")));
        found = true;
        break;
      }
    }
    if (found) continue;
    // Ranks waiting for their peers in the data channel's rendezvous are victims: when they
    // have waited past hang_timeout, the rule names the rank they wait for (the one not in
    // the rendezvous, longest in its phase), or no single rank when every rank is in it.
    // A rank still starting is waited for up to the start timeout.
    const Info* awaited = nullptr;
    int64_t awaited_ms = -1;
    for (const Info* w : ranks) {
      const int64_t age = w->phase_age_ms + (now - w->last_heartbeat_ms);
      if (w->w.phase() != "connecting" && w->w.phase() != "collective" && w->blocked_n == 0 && !silent(*w) &&
          age > awaited_ms) {
        awaited = w;
        awaited_ms = age;
      }
    }
    const int64_t rendezvous_timeout = awaited != nullptr && awaited->w.phase() == "starting"
                                           ? options_.start_timeout_ms
                                           : options_.hang_timeout_ms;
    std::vector<int> connecting;
    int64_t connecting_ms = 0;
    for (const Info* w : ranks) {
      const int64_t age = w->phase_age_ms + (now - w->last_heartbeat_ms);
      if (w->w.phase() == "connecting" && age > rendezvous_timeout) {
        connecting.push_back(w->w.rank());
        connecting_ms = std::max(connecting_ms, age);
      }
    }
    if (!connecting.empty()) {
      const std::string waiters =
          absl::StrCat("rank(s) ", absl::StrJoin(connecting, ", "), " wait in the data channel's rendezvous for ",
                       connecting_ms / secs, " s");
      if (awaited != nullptr) {
        const std::string phase = awaited->w.phase().empty() ? std::string("idle") : awaited->w.phase();
        report(*awaited, FailureOf(*awaited, rackrun::v1::HANG,
                                   absl::StrCat(waiters, " for it; it has been in phase ", phase, " for ",
                                                awaited_ms / secs, " s")));
      } else {
        Failure f = FailureOf(*ranks.front(), rackrun::v1::HANG,
                              absl::StrCat(waiters, "; every rank is in it (check that the ranks can reach "
                                                    "each other's data addresses)"));
        f.set_rank(-1);
        f.clear_worker_id();
        f.clear_host();
        f.set_pid(0);
        f.set_phase("connecting");
        report(*ranks.front(), f);
      }
      continue;
    }
    for (const Info* w : ranks) {
      const std::string& phase = w->w.phase();
      if (phase.empty() || phase == "idle" || phase == "collective" || phase == "connecting" ||
          w->blocked_n != 0 || silent(*w)) {
        continue;
      }
      if (phase == "reporting") {
        // The rank's training is over and its result on the way, which may have waited for
        // this coordinator (restarting) or its own progress reports: counted from the
        // rank's (re-)registration here at the latest and allowed kReportingTimeouts hang
        // timeouts, so only a teardown or report stuck for good is a hang.
        const int64_t age = std::min(w->phase_age_ms + (now - w->last_heartbeat_ms),
                                     now - w->w.registered_unix_ms());
        if (age > kReportingTimeouts * options_.hang_timeout_ms) {
          report(*w, FailureOf(*w, rackrun::v1::HANG,
                               absl::StrCat("in phase reporting (training over, result not "
                                            "delivered) for ", age / secs, " s (", kReportingTimeouts,
                                            " x the hang timeout of ", options_.hang_timeout_ms / secs, " s)")));
          break;
        }
        continue;
      }
      const int64_t age = w->phase_age_ms + (now - w->last_heartbeat_ms);
      // Starting (paths, memory check, model, data) is judged by a timeout of its own: it
      // grows with the model and the machine's load, not with a step.
      const bool starting = phase == "starting";
      const int64_t timeout = starting ? options_.start_timeout_ms : options_.hang_timeout_ms;
      if (age > timeout) {
        report(*w, FailureOf(*w, rackrun::v1::HANG,
                             absl::StrCat("in phase ", phase, " for ", age / secs, " s (",
                                          starting ? "start" : "hang", " timeout ", timeout / secs, " s)")));
        break;
      }
    }
  }
  return out;
}

rackrun::v1::ListWorkersResponse Workers::List(bool include_gone) const {
  Lock lock(mu_);
  const int64_t now = clock_();
  rackrun::v1::ListWorkersResponse resp;
  for (const auto& [id, w] : workers_) {
    if (w.w.state() == rackrun::v1::GONE && !include_gone) continue;
    rackrun::v1::Worker* out = resp.add_workers();
    *out = w.w;
    out->set_heartbeat_age_s((now - w.last_heartbeat_ms) / 1000.0);
  }
  return resp;
}

void Workers::Shutdown() {
  Lock lock(mu_);
  shutdown_ = true;
  cv_.notify_all();
}

}  // namespace rackrun::coordinator
