#!/usr/bin/env bash
# Start a local Prefect server, an MLflow server and (optionally) a Prefect process worker
# on 127.0.0.1, without Docker. Any other bind address turns on both servers' password
# (Prefect's basic auth, MLflow's basic-auth app); CORS and MLflow's Host check always name
# the bind address only (docs/team.md "Beyond one machine"). Idempotent: a service whose pid
# file points at a live process is left alone. Stop them with infra/stop-servers.sh.
#
#   infra/start-servers.sh                  # prefect + mlflow
#   infra/start-servers.sh prefect mlflow worker
#   source "$GRPO_STATE_DIR/env.sh"         # PREFECT_API_URL, MLFLOW_TRACKING_URI for your shell
#
# Settings (environment variables, defaults in brackets):
#   GRPO_STATE_DIR   pid files, logs, databases, artifacts      [./.grpo-servers]
#   GRPO_HOST        bind address                               [127.0.0.1]
#   GRPO_AUTH        USER:PASSWORD both servers ask for; on a non-loopback bind without it a
#                    password is made for user grpo and kept in $GRPO_STATE_DIR/auth
#                    (mode 600); on loopback, set it to turn authentication on   [unset]
#   GRPO_EXPOSE_UNAUTHENTICATED  1: a non-loopback bind without the servers' own passwords,
#                    because an authenticating proxy in front does it            [unset]
#   GRPO_ALLOWED_HOSTS  extra Host names (name or name:port) the servers are reached by,
#                    comma-separated, e.g. the proxy's or the DNS name          [none]
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

# Without a password, through Prefect's API anyone who reaches it runs a deployment with a
# command of their own on the worker; through MLflow's, uploads files and moves the champion
# alias. So a bind beyond loopback gets both servers' passwords, unless the caller says a
# proxy in front authenticates.
AUTH="${GRPO_AUTH:-}"
LOOPBACK=1
case "$HOST" in
    127.* | localhost | ::1) ;;
    *) LOOPBACK=0 ;;
esac
PASSWORD_PART="${AUTH#*:}"
if [ -n "$AUTH" ] && { [[ "$AUTH" != ?*:* ]] || [ "${#PASSWORD_PART}" -lt 12 ]; }; then
    echo "start-servers: GRPO_AUTH must be USER:PASSWORD with a password of 12 characters or more (MLflow's rule)" >&2
    exit 2
fi
if [ "$LOOPBACK" = 0 ] && [ "${GRPO_EXPOSE_UNAUTHENTICATED:-}" = 1 ] && [ -z "$AUTH" ]; then
    echo "start-servers: warning: Prefect and MLflow on $HOST ask for no password (GRPO_EXPOSE_UNAUTHENTICATED=1: a proxy in front must)" >&2
fi

mkdir -p "$STATE/logs" "$STATE/prefect"
chmod 700 "$STATE/logs"  # the servers' logs may quote requests: only this user reads them
STATE="$(cd "$STATE" && pwd)"
if [ "$LOOPBACK" = 0 ] && [ "${GRPO_EXPOSE_UNAUTHENTICATED:-}" != 1 ] && [ -z "$AUTH" ]; then
    if [ ! -s "$STATE/auth" ]; then  # made once, kept: the servers' stores remember the user
        (umask 077 && "$PY" -c "import secrets; print('grpo:' + secrets.token_urlsafe(18))" \
            >"$STATE/auth.tmp" && mv "$STATE/auth.tmp" "$STATE/auth")
        echo "start-servers: $HOST is not loopback: both servers ask for user grpo's password, kept in $STATE/auth" >&2
    fi
    AUTH="$(cat "$STATE/auth")"
fi
AUTH_USER="${AUTH%%:*}"
AUTH_PASSWORD="${AUTH#*:}"
# Set only with a password: Prefect takes an empty PREFECT_SERVER_API_AUTH_STRING as one
SERVER_AUTH=()
CLIENT_AUTH=()
if [ -n "$AUTH" ]; then
    SERVER_AUTH=(PREFECT_SERVER_API_AUTH_STRING="$AUTH")
    CLIENT_AUTH=(PREFECT_API_AUTH_STRING="$AUTH" MLFLOW_TRACKING_USERNAME="$AUTH_USER"
        MLFLOW_TRACKING_PASSWORD="$AUTH_PASSWORD")
fi
BACKEND="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$STATE/mlflow.db}"
ARTIFACTS="${MLFLOW_ARTIFACTS_DESTINATION:-$STATE/mlartifacts}"
URL_HOST="$HOST"
case "$HOST" in *:*) URL_HOST="[$HOST]" ;; esac  # an IPv6 address in a URL or Host header
API_URL="http://$URL_HOST:$PREFECT_PORT/api"
MLFLOW_URL="http://$URL_HOST:$MLFLOW_PORT"

# The names a browser or client may use for each server (the Host header), and so the origins
# a page of the UIs is served from: the bind address, loopback's names when bound there, and
# GRPO_ALLOWED_HOSTS. Another origin's script gets no CORS answer; MLflow also refuses another
# Host header (DNS rebinding). Prefect has no such check: beyond loopback keep its password on
# or a proxy in front.
NAMES="$URL_HOST"
if [ "$LOOPBACK" = 1 ]; then NAMES="localhost,127.0.0.1"; fi
if [ "$HOST" = 0.0.0.0 ] || [ "$HOST" = :: ]; then  # every interface: this machine's names
    NAMES="$(hostname)$(for a in $(hostname -I 2>/dev/null); do
        case "$a" in *:*) printf ',[%s]' "$a" ;; *) printf ',%s' "$a" ;; esac
    done)"
fi
if [ -n "${GRPO_ALLOWED_HOSTS:-}" ]; then NAMES="$NAMES,$GRPO_ALLOWED_HOSTS"; fi
expand() {  # expand PORT PREFIX BARE -> PREFIX+NAME:PORT for each name (a name given with
    # its own port kept as it is), and with BARE=1 the bare NAME too
    local out="" n
    IFS=',' read -ra names <<<"$NAMES"
    for n in "${names[@]}"; do
        if [[ "$n" =~ :[0-9]+$ ]]; then
            out="$out,$2$n"
        else
            out="$out,$2$n:$1"
            if [ "$3" = 1 ]; then out="$out,$n"; fi
        fi
    done
    echo "${out#,}"
}
origins() { expand "$1" http:// 0; }  # origins PORT: the UI pages' origins (CORS)
hosts() { expand "$1" "" 1; }         # hosts PORT: the Host headers (MLflow's --allowed-hosts)

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
        if GRPO_PROBE_AUTH="$AUTH" "$PY" -c "
import base64, os, sys, urllib.request
req = urllib.request.Request(sys.argv[1])
if os.environ['GRPO_PROBE_AUTH']:
    token = base64.b64encode(os.environ['GRPO_PROBE_AUTH'].encode()).decode()
    req.add_header('Authorization', 'Basic ' + token)
urllib.request.urlopen(req, timeout=2)" "$2" 2>/dev/null; then
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
    local name="$1" arg shown=()
    shift
    for arg in "$@"; do  # the log names the credentials it was started with, not their values
        case "$arg" in
            *AUTH_STRING=* | *PASSWORD=* | *USERNAME=*) shown+=("${arg%%=*}=***") ;;
            *) shown+=("$arg") ;;
        esac
    done
    (umask 077 && echo "=== $(date -u +%FT%TZ) starting: ${shown[*]}" >>"$STATE/logs/$name.log")
    # umask 077: what the servers write (Prefect's database, MLflow's password hashes in
    # mlflow-auth.db) is this user's only
    (umask 077 && exec setsid nohup "$@" >>"$STATE/logs/$name.log" 2>&1 </dev/null) &
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
                PREFECT_API_URL="$API_URL" \
                PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS="$(origins "$PREFECT_PORT")" launch prefect \
                env "${SERVER_AUTH[@]}" "$PY" -m prefect server start --host "$HOST" --port "$PREFECT_PORT"; then
                wait_http prefect "$API_URL/health"
                echo "prefect: $API_URL (UI http://$HOST:$PREFECT_PORT, pid $(cat "$STATE/prefect.pid"))"
            fi
            ;;
        mlflow)
            security=(--allowed-hosts "$(hosts "$MLFLOW_PORT")"
                --cors-allowed-origins "$(origins "$MLFLOW_PORT")")
            # MLflow's basic-auth app: its admin is GRPO_AUTH's user; a checked password is
            # remembered 5 minutes (each check is a deliberately slow hash: ~0.1-0.4 s)
            if [ -n "$AUTH" ]; then
                (umask 077 && cat >"$STATE/mlflow-auth.ini" <<EOF
[mlflow]
default_permission = READ
database_uri = sqlite:///$STATE/mlflow-auth.db
admin_username = $AUTH_USER
admin_password = $AUTH_PASSWORD
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = 300
EOF
                )
                security+=(--app-name basic-auth)
            fi
            # (the auth module reads MLFLOW_AUTH_CONFIG_PATH even with the app off: set it
            # only with a password)
            mlflow_auth=()
            if [ -n "$AUTH" ]; then mlflow_auth=(MLFLOW_AUTH_CONFIG_PATH="$STATE/mlflow-auth.ini"); fi
            if (cd "$STATE" && MLFLOW_FLASK_SERVER_SECRET_KEY="${MLFLOW_FLASK_SERVER_SECRET_KEY:-$("$PY" -c 'import secrets; print(secrets.token_hex(32))')}" \
                launch mlflow env "${mlflow_auth[@]}" "$PY" -m mlflow server --host "$HOST" \
                --port "$MLFLOW_PORT" --backend-store-uri "$BACKEND" \
                --artifacts-destination "$ARTIFACTS" --workers 1 "${security[@]}"); then
                wait_http mlflow "$MLFLOW_URL/health"
                echo "mlflow: $MLFLOW_URL (pid $(cat "$STATE/mlflow.pid"))"
            fi
            ;;
        worker)
            # Runs deployments of infra/prefect.yaml; its flow runs start in $GRPO_WORKDIR.
            if (cd "$WORKDIR" && PREFECT_API_URL="$API_URL" MLFLOW_TRACKING_URI="$MLFLOW_URL" \
                GRPO_WORKDIR="$WORKDIR" PREFECT_HOME="$STATE/prefect" launch worker \
                env "${CLIENT_AUTH[@]}" "$PY" -m prefect worker start --pool "$POOL" --type process --limit 1); then
                # the worker creates its pool once started: deploying before that fails
                wait_http worker "$API_URL/work_pools/$POOL" || exit 1
                echo "worker: polling work pool '$POOL' (pid $(cat "$STATE/worker.pid"))"
            fi
            ;;
    esac
done

(umask 077 && cat >"$STATE/env.sh.tmp" <<EOF
# written by infra/start-servers.sh: source it to point grpo, prefect and mlflow at the servers
export PREFECT_API_URL=$API_URL
export MLFLOW_TRACKING_URI=$MLFLOW_URL
export GRPO_WORKDIR=$WORKDIR
EOF
)
if [ -n "$AUTH" ]; then  # the clients' side of the servers' passwords (the file is mode 600)
    printf 'export PREFECT_API_AUTH_STRING=%q\nexport MLFLOW_TRACKING_USERNAME=%q\nexport MLFLOW_TRACKING_PASSWORD=%q\n' \
        "$AUTH" "$AUTH_USER" "$AUTH_PASSWORD" >>"$STATE/env.sh.tmp"
fi
mv "$STATE/env.sh.tmp" "$STATE/env.sh"
echo "environment: source $STATE/env.sh"
