#!/usr/bin/env bash
# On the Ray head node: the Prefect server, the MLflow server and a process worker polling the
# `grpo-ray` work pool (infra/start-servers.sh), then the deployments of infra/ray/prefect.yaml.
# A flow run of `r1-pipeline-ray` is then `grpo run --config configs/gpu.yaml --set
# cluster.backend=ray --set cluster.address=auto ...` on the head: its driver joins this Ray
# cluster and places the rollout replicas and the trainer group on the GPU nodes.
#
#   bash infra/ray/head-worker.sh          # after `ray start --head` (infra/ray/cluster.yaml)
#
# Settings (environment, defaults in brackets): GRPO_WORKSPACE [/mnt/grpo] the file system every
# node mounts (flow runs start there: runs/, mlflow.db); GRPO_HOST [127.0.0.1] where the servers
# listen: the driver and the worker run on the head, and the UIs reach your laptop through a
# tunnel (ssh -L 4200:localhost:4200 -L 5000:localhost:5000 head); another address needs
# GRPO_EXPOSE_UNAUTHENTICATED=1 and a proxy that authenticates (docs/team.md).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORKSPACE="${GRPO_WORKSPACE:-/mnt/grpo}"
export GRPO_HOST="${GRPO_HOST:-127.0.0.1}"
export GRPO_WORK_POOL=grpo-ray
export GRPO_WORKDIR="$WORKSPACE"
export GRPO_STATE_DIR="${GRPO_STATE_DIR:-$WORKSPACE/.grpo-servers}"
export GRPO_PYTHON="${GRPO_PYTHON:-$(command -v python3)}"

ray status >/dev/null || { echo "head-worker: no Ray cluster here (ray start --head first)" >&2; exit 1; }
# flow runs start in $WORKSPACE: the presets there (yours are kept), data/ and runs/ beside them
mkdir -p "$WORKSPACE/configs" && cp -n "$REPO"/configs/*.yaml "$WORKSPACE/configs/"
bash "$REPO/infra/start-servers.sh" prefect mlflow worker
# shellcheck disable=SC1091
source "$GRPO_STATE_DIR/env.sh"
cd "$REPO"
"$GRPO_PYTHON" -m prefect --no-prompt deploy --prefect-file infra/ray/prefect.yaml --all
echo "head-worker: deployment r1-pipeline-ray ready; Prefect UI ${PREFECT_API_URL%/api}"
