#!/usr/bin/env bash
# Stop what infra/start-servers.sh started: SIGTERM to each service's process group, then
# SIGKILL after GRPO_STOP_TIMEOUT seconds [30]. Idempotent: a service that is not running
# (no pid file, or a stale one) is reported and skipped. Databases, artifacts and logs
# under GRPO_STATE_DIR are kept.
#
#   infra/stop-servers.sh                  # worker, mlflow, prefect
#   infra/stop-servers.sh mlflow
set -euo pipefail

STATE="${GRPO_STATE_DIR:-$PWD/.grpo-servers}"
TIMEOUT="${GRPO_STOP_TIMEOUT:-30}"

if [ "$#" -eq 0 ] || [ "$1" = all ]; then set -- worker mlflow prefect; fi

alive() {  # alive PGID -> 0 while any process of the group is running (zombies don't count)
    ps -eo pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'
}

for svc in "$@"; do
    case "$svc" in
        prefect | mlflow | worker) ;;
        *) echo "stop-servers: unknown service '$svc' (prefect, mlflow, worker, all)" >&2; exit 2 ;;
    esac
    pidfile="$STATE/$svc.pid"
    if [ ! -f "$pidfile" ]; then
        echo "$svc: not running"
        continue
    fi
    pid="$(cat "$pidfile")"
    if [ -z "$pid" ] || ! alive "$pid"; then
        echo "$svc: not running (removed stale pid file)"
        rm -f "$pidfile"
        continue
    fi
    # start-servers.sh runs each service in its own session: its pid is the process group id,
    # so the server's own children (uvicorn/gunicorn workers, flow-run subprocesses) stop too.
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + TIMEOUT))
    while alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    if alive "$pid"; then
        echo "$svc: still running after ${TIMEOUT}s, sending SIGKILL"
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
    fi
    rm -f "$pidfile"
    echo "$svc: stopped (pid $pid)"
done
