#!/usr/bin/env bash
# Start a local Prefect server, an MLflow server and (optionally) a Prefect process worker
# on 127.0.0.1, without Docker. Idempotent: a service whose pid file points at a live
# process is left alone. Stop them with infra/stop-servers.sh.
#
#   infra/start-servers.sh                  # prefect + mlflow
#   infra/start-servers.sh prefect mlflow worker
#   source "$GRPO_STATE_DIR/env.sh"         # PREFECT_API_URL, MLFLOW_TRACKING_URI for your shell
#
# Settings (environment variables, defaults in brackets):
#   GRPO_STATE_DIR   pid files, logs, databases, artifacts      [./.grpo-servers]
#   GRPO_HOST        bind address                               [127.0.0.1]
#   GRPO_EXPOSE_UNAUTHENTICATED  1: allow a bind address other than loopback (neither server
#                    authenticates anyone: put an authenticating proxy or a VPN in front,
#                    docs/team.md "Beyond one machine")                [unset: refused]
#   PREFECT_PORT     Prefect API + UI                           [4200]
#   MLFLOW_PORT      MLflow tracking server + UI                [5000]
#   MLFLOW_BACKEND_STORE_URI   runs and model registry          [sqlite:///$GRPO_STATE_DIR/mlflow.db]
#   MLFLOW_ARTIFACTS_DESTINATION  artifact root (proxied)       [$GRPO_STATE_DIR/mlartifacts]
#   GRPO_WORK_POOL   process work pool the worker polls         [grpo-local]
#   GRPO_WORKDIR     working directory of flow runs (worker)    [current directory]
#   GRPO_PYTHON      interpreter that has prefect and mlflow    [python3]
#   GRPO_START_TIMEOUT  seconds to wait for a server to answer  [120]
set -euo pipefail

STATE="${GRPO_STATE_DIR:-$PWD/.grpo-servers}"
HOST="${GRPO_HOST:-127.0.0.1}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
PY="${GRPO_PYTHON:-python3}"
POOL="${GRPO_WORK_POOL:-grpo-local}"
WORKDIR="${GRPO_WORKDIR:-$PWD}"
TIMEOUT="${GRPO_START_TIMEOUT:-120}"

# Neither server authenticates: through Prefect's API anyone who reaches it runs a deployment
# with a command of their own on the worker; through MLflow's, uploads files and moves the
# champion alias. Loopback only, unless the caller says a proxy guards it.
case "$HOST" in
    127.* | localhost | ::1) ;;
    *)
        if [ "${GRPO_EXPOSE_UNAUTHENTICATED:-}" != 1 ]; then
            echo "start-servers: GRPO_HOST=$HOST would expose Prefect and MLflow, which authenticate no one, to every machine that reaches it; keep 127.0.0.1 and use an SSH tunnel (ssh -L 4200:localhost:4200 -L 5000:localhost:5000 HOST), or put an authenticating proxy in front and set GRPO_EXPOSE_UNAUTHENTICATED=1 (docs/team.md)" >&2
            exit 2
        fi
        echo "start-servers: warning: Prefect and MLflow on $HOST authenticate no one (GRPO_EXPOSE_UNAUTHENTICATED=1)" >&2
        ;;
esac

mkdir -p "$STATE/logs" "$STATE/prefect"
STATE="$(cd "$STATE" && pwd)"
BACKEND="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$STATE/mlflow.db}"
ARTIFACTS="${MLFLOW_ARTIFACTS_DESTINATION:-$STATE/mlartifacts}"
API_URL="http://$HOST:$PREFECT_PORT/api"
MLFLOW_URL="http://$HOST:$MLFLOW_PORT"

# A copy of the server-side telemetry defaults; the source of truth for Python is flows/env.py.
export PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true


if [ "$#" -eq 0 ]; then set -- prefect mlflow; fi
for svc in "$@"; do
    case "$svc" in
        prefect | mlflow | worker) ;;
        all) set -- prefect mlflow worker; break ;;
        *) echo "start-servers: unknown service '$svc' (prefect, mlflow, worker, all)" >&2; exit 2 ;;
    esac
done

running() {  # running NAME -> 0 when its pid file names a live process
    local pidfile="$STATE/$1.pid" pid
    [ -f "$pidfile" ] || return 1
    pid="$(cat "$pidfile")"
    if [ -n "$pid" ] && ps -eo pgid=,stat= |
        awk -v g="$pid" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'; then
        return 0
    fi
    rm -f "$pidfile"  # stale: the process is gone
    return 1
}

wait_http() {  # wait_http NAME URL
    local deadline=$((SECONDS + TIMEOUT))
    while [ "$SECONDS" -lt "$deadline" ]; do
        if ! running "$1"; then
            echo "start-servers: $1 exited during start-up; last lines of $STATE/logs/$1.log:" >&2
            tail -n 30 "$STATE/logs/$1.log" >&2 || true
            return 1
        fi
        if "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$2" 2>/dev/null; then
            return 0
        fi
        sleep 0.5
    done
    echo "start-servers: $1 did not answer $2 within ${TIMEOUT}s (log: $STATE/logs/$1.log)" >&2
    return 1
}

launch() {  # launch NAME CMD... : new session (pid = process group id), output to the log
    if running "$1"; then
        echo "$1: already running (pid $(cat "$STATE/$1.pid"))"
        return 1
    fi
    local name="$1"
    shift
    echo "=== $(date -u +%FT%TZ) starting: $*" >>"$STATE/logs/$name.log"
    setsid nohup "$@" >>"$STATE/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$STATE/$name.pid"
    return 0
}

for svc in "$@"; do
    case "$svc" in
        prefect)
            # The UI asks /ui-settings where its API is: that answer comes from the server's
            # settings, not from --port (left alone it is :4200, "Can't connect to Server API")
            if PREFECT_HOME="$STATE/prefect" PREFECT_SERVER_API_HOST="$HOST" \
                PREFECT_SERVER_API_PORT="$PREFECT_PORT" PREFECT_UI_API_URL="$API_URL" \
                PREFECT_API_URL="$API_URL" launch prefect \
                "$PY" -m prefect server start --host "$HOST" --port "$PREFECT_PORT"; then
                wait_http prefect "$API_URL/health"
                echo "prefect: $API_URL (UI http://$HOST:$PREFECT_PORT, pid $(cat "$STATE/prefect.pid"))"
            fi
            ;;
        mlflow)
            if (cd "$STATE" && launch mlflow "$PY" -m mlflow server --host "$HOST" \
                --port "$MLFLOW_PORT" --backend-store-uri "$BACKEND" \
                --artifacts-destination "$ARTIFACTS" --workers 1); then
                wait_http mlflow "$MLFLOW_URL/health"
                echo "mlflow: $MLFLOW_URL (pid $(cat "$STATE/mlflow.pid"))"
            fi
            ;;
        worker)
            # Runs deployments of infra/prefect.yaml; its flow runs start in $GRPO_WORKDIR.
            if (cd "$WORKDIR" && PREFECT_API_URL="$API_URL" MLFLOW_TRACKING_URI="$MLFLOW_URL" \
                GRPO_WORKDIR="$WORKDIR" PREFECT_HOME="$STATE/prefect" launch worker \
                "$PY" -m prefect worker start --pool "$POOL" --type process --limit 1); then
                # the worker creates its pool once started: deploying before that fails
                wait_http worker "$API_URL/work_pools/$POOL" || exit 1
                echo "worker: polling work pool '$POOL' (pid $(cat "$STATE/worker.pid"))"
            fi
            ;;
    esac
done

cat >"$STATE/env.sh" <<EOF
# written by infra/start-servers.sh: source it to point grpo, prefect and mlflow at the servers
export PREFECT_API_URL=$API_URL
export MLFLOW_TRACKING_URI=$MLFLOW_URL
export GRPO_WORKDIR=$WORKDIR
EOF
echo "environment: source $STATE/env.sh"
