#include "coordinator/workers.h"

#include <algorithm>
#include <chrono>
#include <iterator>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "rpc/liveness.h"
#include "rpc/rack_label.h"

namespace rackrun::coordinator {

Workers::Workers(Clock clock, Options options, std::function<absl::StatusOr<int64_t>()> next_number)
    : clock_(std::move(clock)), options_(options), next_number_(std::move(next_number)) {}

Workers::Info* Workers::Find(const std::string& id) {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::string> Workers::Register(const rackrun::v1::RegisterRequest& req) {
  if (req.host().empty())
    return absl::InvalidArgumentError("host: required (the worker's host name)");
  if (absl::Status s = rpc::CheckRackLabel(req.rack()); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rack: ", s.message(), "; set the worker's --rack"));
  }
  const bool fresh = req.worker_id().empty();
  std::string id = req.worker_id();
  if (fresh) {
    absl::StatusOr<std::string> minted = NewId();
    if (!minted.ok()) return minted.status();
    id = *std::move(minted);
  }
  Lock lock(mu_);
  if (shutdown_) return absl::UnavailableError("the coordinator is shutting down");
  if (fresh && workers_.contains(id)) {
    // A worker that kept this id registered again since NewId looked.
    return absl::UnavailableError(
        absl::StrCat("worker id ", id, " was just taken; register again"));
  }
  if (absl::Status s = CheckRoomLocked(id); !s.ok()) return s;
  const int64_t now = clock_();
  Info& w = workers_[id];
  // A stream of the old registration ends. Generations never repeat, not even for a
  // forgotten worker that registers again with its id (ForgetEnded).
  const int64_t generation = ++generations_;
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
  w.w.set_data_address(req.data_address());
  w.w.set_ucx_address(req.ucx_address());
  w.w.set_metrics_address(req.metrics_address());
  w.w.set_rack(req.rack());
  if (req.has_gpu()) *w.w.mutable_gpu() = req.gpu();
  w.stopping_job = req.job_id();
  w.last_heartbeat_ms = now;
  cv_.notify_all();
  return id;
}

absl::StatusOr<std::string> Workers::NewId() {
  // An id the counter has not reached yet is held only by a worker that kept it from a job
  // store this coordinator no longer has (one older than RegisterRequest.store_id: newer
  // ones get a new id); each such worker costs at most one number here.
  for (int tries = 0; tries < 100000; ++tries) {
    absl::StatusOr<int64_t> n = next_number_();
    if (!n.ok()) return n.status();
    std::string id = absl::StrCat("w-", *n);
    Lock lock(mu_);
    if (!workers_.contains(id)) return id;
  }
  return absl::InternalError("no free worker id after 100000 tries");
}

absl::Status Workers::CheckRoomLocked(const std::string& id) const {
  int live = 0;
  for (const auto& [other, w] : workers_) {
    if (w.w.state() == rackrun::v1::LOST || w.w.state() == rackrun::v1::GONE) continue;
    if (other == id) return absl::OkStatus();  // it registers again: no new one
    ++live;
  }
  if (live < options_.max_live) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("RackControl.Register: ", live,
                   " workers are live on this coordinator, its limit "
                   "(--max-workers ",
                   options_.max_live,
                   "); stop workers that should not be running, or "
                   "start the coordinator with a higher --max-workers"));
}

absl::Status Workers::Heartbeat(const rackrun::v1::HeartbeatRequest& req,
                                rackrun::v1::HeartbeatResponse* resp) {
  Lock lock(mu_);
  Info* w = Find(req.worker_id());
  if (w == nullptr || w->w.state() == rackrun::v1::LOST || w->w.state() == rackrun::v1::GONE) {
    return absl::NotFoundError(
        absl::StrCat("worker '", req.worker_id(), "' is not registered; register again"));
  }
  const int64_t now = clock_();
  w->last_heartbeat_ms = now;
  if (req.job_id().empty()) {
    w->stopping_job.clear();
  } else if (w->w.state() != rackrun::v1::BUSY) {
    // Still in an attempt that ended here (its rank was named while the link was cut, and
    // it is still stopping or reporting): not placeable until it says it runs none.
    w->stopping_job = req.job_id();
  }
  w->w.set_step(req.step());
  w->w.set_phase(req.phase());
  w->phase = rpc::ParsePhase(req.phase());
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
  // Acknowledgements: a value above what was written is from before a registration.
  const int64_t received = std::min(req.assignments_received(), w->written);
  if (received > w->acknowledged) {
    w->acknowledged = received;
    w->unacknowledged_since_ms = now;  // the rest is timed from this progress
  }
  const bool stalled = w->stream_open && w->acknowledged < w->written &&
                       now - w->unacknowledged_since_ms > StallAfterMs();
  if (stalled) w->unacknowledged_since_ms = now;  // said once per wait
  if (resp != nullptr) {
    resp->set_stream_closed(w->stream_seen && !w->stream_open);
    resp->set_stream_stalled(stalled);
  }
  return absl::OkStatus();
}

int64_t Workers::StallAfterMs() const {
  const std::chrono::milliseconds interval(options_.heartbeat_interval_ms);
  return (rpc::LivenessFor(interval, std::chrono::milliseconds(options_.heartbeat_timeout_ms))
              .late_after +
          interval)
      .count();
}

absl::Status Workers::Deregister(const std::string& worker_id) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w == nullptr)
    return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' is not registered"));
  const int64_t now = clock_();
  End(*w, rackrun::v1::GONE, now);
  w->generation = ++generations_;
  w->stream_open = false;
  w->stream_closed_ms = now;
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Workers::OpenStream(const std::string& worker_id) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w == nullptr || w->w.state() == rackrun::v1::LOST || w->w.state() == rackrun::v1::GONE) {
    return absl::NotFoundError(
        absl::StrCat("worker '", worker_id, "' is not registered; register first"));
  }
  w->generation = ++generations_;
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
      if (w->acknowledged >= w->written) w->unacknowledged_since_ms = clock_();
      w->written = a.sequence();
      return std::optional<rackrun::v1::Assignment>(std::move(a));
    }
    if (WaitUntil(cv_, lock, deadline)) return std::optional<rackrun::v1::Assignment>();
  }
}

void Workers::CloseStream(const std::string& worker_id, int64_t generation) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w != nullptr && w->generation == generation) {
    w->stream_open = false;
    w->stream_closed_ms = clock_();
  }
}

void Workers::Push(const std::string& worker_id, const rackrun::v1::Assignment& a) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w == nullptr || w->w.state() == rackrun::v1::GONE) return;
  if (a.has_run()) w->run = a.run();
  w->outbox.push_back(a);
  w->outbox.back().set_sequence(++w->pushed);
  cv_.notify_all();
}

std::optional<rackrun::v1::RunJob> Workers::BusyRun(const std::string& worker_id) const {
  Lock lock(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return std::nullopt;
  const Info& w = it->second;
  if (w.w.state() != rackrun::v1::BUSY || !w.run.has_value() || w.run->job_id() != w.w.job_id() ||
      w.run->attempt() != w.attempt) {
    return std::nullopt;
  }
  return w.run;
}

void Workers::SetBusy(const std::string& worker_id, const std::string& job_id, int attempt,
                      int rank) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w == nullptr) return;
  w->w.set_state(rackrun::v1::BUSY);
  w->stopping_job.clear();
  w->w.set_job_id(job_id);
  w->w.set_rank(rank);
  w->attempt = attempt;
  w->blocked_n = 0;
  w->entered = w->completed = 0;
  w->phase_age_ms = 0;
  w->phase = rpc::Phase::kStarting;
  w->w.set_phase(rpc::PhaseName(w->phase));
  w->last_heartbeat_ms = std::max(w->last_heartbeat_ms, clock_());
}

void Workers::SetIdle(const std::string& worker_id, const std::string& job_id) {
  Release(worker_id, job_id, rackrun::v1::IDLE);
}

void Workers::SetDraining(const std::string& worker_id, const std::string& job_id) {
  Release(worker_id, job_id, rackrun::v1::DRAINING);
}

void Workers::Release(const std::string& worker_id, const std::string& job_id,
                      rackrun::v1::WorkerState to) {
  Lock lock(mu_);
  Info* w = Find(worker_id);
  if (w == nullptr || (!job_id.empty() && w->w.job_id() != job_id)) return;
  if (w->w.state() == rackrun::v1::BUSY) w->w.set_state(to);
  w->w.clear_job_id();
  w->w.set_rank(0);
  w->attempt = 0;
  w->blocked_n = 0;
  w->phase = rpc::Phase::kIdle;
  w->w.set_phase(rpc::PhaseName(w->phase));
}

std::vector<IdleWorker> Workers::Idle() const {
  Lock lock(mu_);
  std::vector<IdleWorker> out;
  for (const auto& [id, w] : workers_) {
    if (w.w.state() != rackrun::v1::IDLE || !w.stream_open || !w.stopping_job.empty()) continue;
    IdleWorker i{id, w.w.host(), w.w.pid(), w.w.launcher_rank(), w.data_address, {}, w.w.rack()};
    i.channels.assign(w.w.channels().begin(), w.w.channels().end());
    i.gpu = w.w.has_gpu();
    i.gpu_bytes = w.w.gpu().total_bytes();
    out.push_back(std::move(i));
  }
  return out;
}

int Workers::BusyGpuWorkers() const {
  Lock lock(mu_);
  int busy = 0;
  for (const auto& [id, w] : workers_)
    if (w.w.state() == rackrun::v1::BUSY && w.w.has_gpu()) ++busy;
  return busy;
}

absl::StatusOr<rackrun::v1::RankPlacement> Workers::Placement(const std::string& worker_id) const {
  Lock lock(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end())
    return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' is not registered"));
  rackrun::v1::RankPlacement p;
  p.set_worker_id(worker_id);
  p.set_host(it->second.w.host());
  p.set_pid(it->second.w.pid());
  p.set_rack(it->second.w.rack());
  return p;
}

int Workers::AttemptsTracked() const {
  Lock lock(mu_);
  return static_cast<int>(reported_.size());
}

std::vector<Finding> Workers::Detect() {
  Lock lock(mu_);
  const int64_t now = clock_();
  // The busy workers of each running attempt not reported yet, as the rules see them.
  std::map<std::pair<std::string, int>, AttemptSnapshot> attempts;
  std::set<std::pair<std::string, int>> busy;  // the attempts some worker is busy with
  for (const auto& [id, w] : workers_) {
    if (w.w.state() != rackrun::v1::BUSY || w.w.job_id().empty()) continue;
    const auto key = std::make_pair(w.w.job_id(), w.attempt);
    busy.insert(key);
    if (reported_[key]) continue;
    AttemptSnapshot& a = attempts[key];
    a.job_id = w.w.job_id();
    a.attempt = w.attempt;
    a.ranks.push_back(SnapshotOf(w));
  }
  // An attempt no worker is busy with any more is forgotten: its verdict, if any, was
  // given, and the map would otherwise hold every attempt of the coordinator's life.
  std::erase_if(reported_, [&busy](const auto& entry) { return !busy.contains(entry.first); });
  // The exit window keeps its default (failure_detector.h, exit_window_ms); a rank is late
  // after the gap one missed heartbeat explains (rpc/liveness.h).
  DetectionTimeouts timeouts{options_.heartbeat_timeout_ms, options_.hang_timeout_ms,
                             options_.start_timeout_ms};
  timeouts.late_after_ms =
      rpc::LivenessFor(std::chrono::milliseconds(options_.heartbeat_interval_ms),
                       std::chrono::milliseconds(options_.heartbeat_timeout_ms))
          .late_after.count();
  // Bookkeeping: a stream closed while heartbeats were fresh means the process is gone; an
  // idle worker with a closed stream or that stopped heartbeating is gone too. A busy rank
  // whose stream keepalive dropped after it fell silent stays in its attempt until the
  // rules have named the attempt's failure (HANG when peers wait for it, else
  // WORKER_LOST for the silence); it is lost after that.
  for (auto& [id, w] : workers_) {
    const auto s = w.w.state();
    if (s == rackrun::v1::LOST || s == rackrun::v1::GONE) continue;
    const StreamState stream = StreamStateOf(SnapshotOf(w), now, timeouts);
    const auto report = reported_.find(std::make_pair(w.w.job_id(), w.attempt));
    const bool named = s == rackrun::v1::BUSY && report != reported_.end() && report->second;
    if (stream == StreamState::kExited ||
        (stream == StreamState::kDroppedSilent && (s != rackrun::v1::BUSY || named)) ||
        ((s == rackrun::v1::IDLE || s == rackrun::v1::DRAINING) &&
         now - w.last_heartbeat_ms > options_.heartbeat_timeout_ms)) {
      End(w, rackrun::v1::LOST, now);
    }
  }
  // Closed streams first, by worker id, then the other findings by attempt.
  std::vector<Finding> out, others;
  for (auto& [key, attempt] : attempts) {
    std::stable_sort(attempt.ranks.begin(), attempt.ranks.end(),
                     [](const RankSnapshot& a, const RankSnapshot& b) { return a.rank < b.rank; });
    std::optional<Finding> f = DetectFailure(attempt, now, timeouts);
    if (!f.has_value()) continue;
    reported_[key] = true;
    if (f->rule == DetectionRule::kLostSilence) {
      if (Info* lost = Find(f->failure.worker_id()); lost != nullptr)
        End(*lost, rackrun::v1::LOST, now);
    }
    (f->rule == DetectionRule::kLostStream ? out : others).push_back(std::move(*f));
  }
  std::stable_sort(out.begin(), out.end(), [](const Finding& a, const Finding& b) {
    return a.failure.worker_id() < b.failure.worker_id();
  });
  out.insert(out.end(), std::make_move_iterator(others.begin()),
             std::make_move_iterator(others.end()));
  ForgetEnded(now);
  return out;
}

void Workers::End(Info& w, rackrun::v1::WorkerState state, int64_t now) {
  w.w.set_state(state);
  w.ended_ms = now;
}

void Workers::ForgetEnded(int64_t now) {
  std::vector<std::pair<int64_t, std::string>> ended;  // (ended_ms, id)
  for (const auto& [id, w] : workers_) {
    const auto s = w.w.state();
    if (s == rackrun::v1::LOST || s == rackrun::v1::GONE) ended.emplace_back(w.ended_ms, id);
  }
  const size_t keep = static_cast<size_t>(std::max(0, options_.max_ended));
  if (ended.size() <= keep && std::none_of(ended.begin(), ended.end(), [&](const auto& e) {
        return now - e.first > options_.forget_after_ms;
      })) {
    return;  // the usual tick: nothing to forget, nothing sorted
  }
  std::sort(ended.begin(), ended.end());
  for (size_t i = 0; i < ended.size(); ++i) {
    if (ended.size() - i <= keep && now - ended[i].first <= options_.forget_after_ms) break;
    workers_.erase(ended[i].second);
  }
}

RankSnapshot Workers::SnapshotOf(const Info& w) {
  RankSnapshot r;
  r.rank = w.w.rank();
  r.worker_id = w.w.id();
  r.host = w.w.host();
  r.pid = w.w.pid();
  r.phase_name = w.w.phase();
  r.phase = w.phase;
  r.step = w.w.step();
  r.registered_ms = w.w.registered_unix_ms();
  r.last_heartbeat_ms = w.last_heartbeat_ms;
  r.phase_age_ms = w.phase_age_ms;
  r.entered = w.entered;
  r.blocked_n = w.blocked_n;
  r.blocked_since_ms = w.blocked_since_ms;
  r.stream_seen = w.stream_seen;
  r.stream_open = w.stream_open;
  r.stream_closed_ms = w.stream_closed_ms;
  return r;
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
