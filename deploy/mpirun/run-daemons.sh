#!/usr/bin/env bash
# One machine, the daemon way: starts a rackrun-coordinator (loopback, a free port, its own
# state folder) and N rackrun-worker daemons under `mpirun -np N`, waits until all N have
# registered, submits SPEC with `rackrun submit --watch` (a live progress bar on a terminal,
# plain lines otherwise), and then shuts everything down cleanly: SIGTERM to every worker
# (each drains and exits 0), then to the coordinator; also on Ctrl-C, SIGTERM or any error
# (jobs still queued or running are cancelled first). Exits with the job's outcome as
# `rackrun watch` does: 0 SUCCEEDED, 1 FAILED, 2 CANCELLED, 3 no outcome; 4 when the daemons
# could not be started.
#
#   deploy/mpirun/run-daemons.sh [OPTION]... SPEC [SUBMIT-OPTION]...
#
#   -n, --workers N    worker daemons, and the job's resources.ranks (default 2)
#   --threads N        compute threads per worker (default: the spec's resources.threads)
#   --state-dir DIR    the coordinator's state (job database, token, logs of both daemons;
#                      default: a new folder under ${TMPDIR:-/tmp}); reused if it exists
#   --build DIR        build folder with the three binaries (default $RACKRUN_BUILD_DIR or build/)
#   --host ADDR        address the daemons listen on (default 127.0.0.1; loopback only)
#   --keep-running     after the job, leave the daemons up (prints how to stop them)
# SUBMIT-OPTIONs go to `rackrun submit` after --set resources.ranks=N, e.g.
# --set training.steps=50 or --plain. Paths in SPEC are resolved from the current folder.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${RACKRUN_BUILD_DIR:-$root/build}"
workers=2 threads="" state="" host=127.0.0.1 keep=0
me="run-daemons"
say() { echo "$me: $*" >&2; }
usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    -n|--workers) workers="${2:?$1 needs a number}"; shift 2 ;;
    --threads) threads="${2:?--threads needs a number}"; shift 2 ;;
    --state-dir) state="${2:?--state-dir needs a folder}"; shift 2 ;;
    --build) build="${2:?--build needs a folder}"; shift 2 ;;
    --host) host="${2:?--host needs an address}"; shift 2 ;;
    --keep-running) keep=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) say "unknown option '$1' before SPEC (see --help)"; exit 4 ;;
    *) break ;;
  esac
done
(($#)) || { say "no SPEC given (see --help)"; exit 4; }
spec="$1"; shift
[[ -f "$spec" ]] || { say "SPEC '$spec' not found from $PWD"; exit 4; }
[[ "$workers" =~ ^[1-9][0-9]*$ ]] || { say "--workers must be a positive integer, got '$workers'"; exit 4; }
if [[ -n "$threads" ]] && ! [[ "$threads" =~ ^[1-9][0-9]*$ ]]; then
  say "--threads must be a positive integer, got '$threads'"; exit 4
fi
coordinator_bin="$build/coordinator/rackrun-coordinator"
worker_bin="$build/worker/rackrun-worker"
cli="$build/tools/rackrun"
for b in "$coordinator_bin" "$worker_bin" "$cli"; do
  [[ -x "$b" ]] || { say "'$b' is missing: build it (tools/build) or pass --build DIR"; exit 4; }
done
command -v mpirun >/dev/null || { say "mpirun not found: install Open MPI (tools/setup)"; exit 4; }
[[ -n "$state" ]] || state="$(mktemp -d "${TMPDIR:-/tmp}/rackrun-daemons.XXXXXX")"
mkdir -p "$state"
state="$(cd "$state" && pwd)"

coordinator_pid="" mpirun_pid="" worker_pids=() outcome=3 interrupted=0 ready=0

# free_port: a TCP port nobody listens on now (for the optional metrics/dashboard servers).
free_port() {
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 40000))
    if ! ss -ltnH "sport = :$p" 2>/dev/null | grep . >/dev/null; then echo "$p"; return; fi
  done
  echo $((20000 + RANDOM % 40000))
}

# stop PID NAME SECONDS: SIGTERM, wait up to SECONDS, then SIGKILL.
stop() {
  local pid="$1" name="$2" limit="$3" i
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < limit * 10; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    say "$name (pid $pid) still running $limit s after SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

shutdown() {
  local rc=$? pid i
  trap - EXIT INT TERM
  if ((keep && !interrupted && ready)); then
    say "daemons left running: stop them with: kill -TERM ${worker_pids[*]} && kill -TERM $coordinator_pid"
    exit "$rc"
  fi
  # A job still queued or running (Ctrl-C, an error) is cancelled so every rank stops at
  # one step boundary; the coordinator's state is this script's own, so all its jobs are ours.
  if [[ -n "$coordinator_pid" ]] && kill -0 "$coordinator_pid" 2>/dev/null; then
    for s in running queued; do
      timeout 20 "$cli" list --state "$s" 2>/dev/null | awk 'NR > 1 { print $1 }' |
        while read -r job; do
          timeout 20 "$cli" cancel "$job" --reason "$me stopped" >&2 2>/dev/null || true
        done || true
    done
  fi
  # Workers first (each finishes its step, checkpoints, deregisters, exits 0), then mpirun
  # ends by itself; the coordinator last.
  for pid in "${worker_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  if [[ -n "$mpirun_pid" ]]; then
    for ((i = 0; i < 1200; i++)); do kill -0 "$mpirun_pid" 2>/dev/null || break; sleep 0.1; done
    stop "$mpirun_pid" "mpirun (workers)" 10
  fi
  stop "$coordinator_pid" rackrun-coordinator 30
  [[ -n "$coordinator_pid" ]] && say "daemons stopped; logs and job database in $state"
  exit "$rc"
}
trap shutdown EXIT
trap 'interrupted=1; say "interrupted: cancelling the job and stopping the daemons"; exit 130' INT
trap 'interrupted=1; say "SIGTERM: cancelling the job and stopping the daemons"; exit 143' TERM

die_log() {  # die_log LOG MESSAGE: the message, the log's tail, exit 4
  say "$2"
  tail -n 20 "$1" 2>/dev/null | sed 's/^/    /' >&2
  exit 4
}

# ---- coordinator: port 0, the bound port is read from its banner ----
extra=() urls=()
help="$("$coordinator_bin" --help 2>&1 || true)"
if grep -q -- '--metrics-listen' <<<"$help"; then
  p="$(free_port)"; extra+=(--metrics-listen "$host:$p"); urls+=("metrics (Prometheus): http://$host:$p/metrics")
fi
if grep -q -- '--dashboard-listen' <<<"$help"; then
  p="$(free_port)"; extra+=(--dashboard-listen "$host:$p"); urls+=("dashboard: http://$host:$p/")
fi
# setsid: Ctrl-C on the terminal reaches this script only; the daemons are stopped in order.
setsid "$coordinator_bin" --listen "$host:0" --state-dir "$state" ${extra[@]+"${extra[@]}"} \
  >"$state/coordinator.log" 2>&1 &
coordinator_pid=$!
banner=""
for ((i = 0; i < 300; i++)); do
  banner="$(grep -m1 'rackrun-coordinator: listening on' "$state/coordinator.log" || true)"
  [[ -n "$banner" ]] && break
  kill -0 "$coordinator_pid" 2>/dev/null || die_log "$state/coordinator.log" "rackrun-coordinator exited at start:"
  sleep 0.1
done
[[ -n "$banner" ]] || die_log "$state/coordinator.log" "rackrun-coordinator printed no banner in 30 s:"
port="$(sed -n 's/.*listening on [^ ]*:\([0-9]*\),.*/\1/p' <<<"$banner")"
# A non-loopback --host gets TLS with the coordinator's own CA: the join tokens pin it.
join=""
[[ -f "$state/join-token-worker" ]] && join="join-"
export RACKRUN_COORDINATOR="$host:$port" RACKRUN_TOKEN_FILE="$state/${join}token-user"
unset RACKRUN_TOKEN
echo "$banner"
for u in ${urls[@]+"${urls[@]}"}; do echo "$me: $u"; done

# ---- workers: mpirun -np N, no MPI world (each registers on its own) ----
# No OpenBLAS thread pool (the trainer keeps OpenBLAS single-threaded anyway): workers built
# before SIGTERM went through a handler died, instead of draining, when the signal landed on
# one of the pool's threads.
export OPENBLAS_NUM_THREADS=1
mpi=(mpirun --oversubscribe -np "$workers")
[[ $(id -u) == 0 ]] && mpi+=(--allow-run-as-root)
worker_args=(--coordinator "$RACKRUN_COORDINATOR" --token-file "$state/${join}token-worker" --data-address "$host")
[[ -n "$threads" ]] && worker_args+=(--threads "$threads")
setsid "${mpi[@]}" "$worker_bin" "${worker_args[@]}" >"$state/workers.log" 2>&1 &
mpirun_pid=$!
registered=0
for ((i = 0; i < 240; i++)); do   # 120 s
  mapfile -t worker_pids < <(sed -n 's/^rackrun-worker: pid \([0-9]*\),.*/\1/p' "$state/workers.log")
  registered="$("$cli" workers 2>/dev/null | grep -cw IDLE || true)"
  ((registered >= workers && ${#worker_pids[@]} >= workers)) && break
  kill -0 "$mpirun_pid" 2>/dev/null || die_log "$state/workers.log" "the workers exited at start (mpirun):"
  sleep 0.5
done
((registered >= workers)) ||
  die_log "$state/workers.log" "only $registered of $workers workers registered in 120 s:"
echo "$me: $workers workers registered (mpirun -np $workers rackrun-worker); daemon logs in $state"
ready=1

# ---- the job ----
outcome=0
"$cli" submit "$spec" --set "resources.ranks=$workers" "$@" --watch || outcome=$?
case "$outcome" in
  0) echo "$me: job SUCCEEDED" ;;
  1) say "job FAILED (rackrun list / rackrun status JOB; worker logs: $state/workers.log)" ;;
  2) say "job CANCELLED" ;;
  *) say "no outcome (exit $outcome): see above and $state/coordinator.log" ;;
esac
exit "$outcome"
