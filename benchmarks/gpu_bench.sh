#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): every training path on one GPU, one table.
# Run from the repository root (docs/cluster.md, "GPU readiness"):
#
#   bash benchmarks/gpu_bench.sh [--wheelhouse DIR] [--quick] [gpu_check.py options ...]
#   (the interpreter: $PYTHON, default python3; activate the project venv where there is one)
#
# 1. the packages: if prefect, mlflow, datasets and math_verify already import, nothing is
#    installed; else with a wheelhouse (--wheelhouse DIR, or .gpu/whl when it exists; made by
#    benchmarks/make_wheelhouse.sh on a connected machine) it is installed with
#      python3 -m pip install --no-index --no-deps --no-compile --target /tmp/grpo-site DIR/*.whl
#    and PYTHONPATH becomes /tmp/grpo-site plus this checkout (no registry needed, the
#    machine's torch stays); else the project goes into a venv from the package registry
#    ($GPU_BENCH_VENV, default /tmp/grpo-gpu-venv; `pip install -e ".[bench]"`);
# 2. benchmarks/gpu_check.py with `python3 -m flows.cli` from the checkout (never the `grpo`
#    script: the machine's torch need not be our pin), its logs, table (gpu_check.md/.json)
#    and all_logs.txt in $OUT (default benchmarks/out/gpu_check).
#
# --quick: the smallest budgets and a toy probe, a dry run on a CPU (the CUDA-only legs print
# why they skip). Exit status: gpu_check.py's (1 when a leg failed).
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PYTHONUNBUFFERED=1
wheelhouse="" quick=() rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheelhouse) wheelhouse=$2; shift 2 ;;
    --quick) quick=(--quick); shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) rest+=("$1"); shift ;;
  esac
done
[ -z "$wheelhouse" ] && [ -d .gpu/whl ] && wheelhouse=.gpu/whl
OUT=${OUT:-benchmarks/out/gpu_check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

need="import prefect, mlflow, datasets, math_verify, pydantic, torch, transformers"
t0=$(date +%s)
if PYTHONPATH=$PWD "$PY" -c "$need" 2>/dev/null; then
  echo "gpu_bench: the packages import here; nothing to install"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
elif [ -n "$wheelhouse" ]; then
  site=${GPU_BENCH_SITE:-/tmp/grpo-site}
  echo "gpu_bench: installing $(ls "$wheelhouse"/*.whl | wc -l) wheels from $wheelhouse into $site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheelhouse"/*.whl \
    || { echo "gpu_bench: the wheelhouse did not install" >&2; exit 1; }
  export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  "$PY" -c "$need" || { echo "gpu_bench: still missing a package (see above)" >&2; exit 1; }
else
  VENV=${GPU_BENCH_VENV:-/tmp/grpo-gpu-venv}
  [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
  # the machine's torch when it has one: the project without its torch pin, then the rest
  if ! timeout 600 "$VENV/bin/pip" install -q -e ".[bench]"; then
    echo "gpu_bench: no wheelhouse and no package registry here: make one with" >&2
    echo "  bash benchmarks/make_wheelhouse.sh   (on a connected machine; docs/cluster.md)" >&2
    exit 1
  fi
  PY=$VENV/bin/python
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
echo "gpu_bench: packages ready in $(( $(date +%s) - t0 )) s"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
"$PY" -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: does not import (vLLM legs skip)"

t0=$(date +%s)
"$PY" benchmarks/gpu_check.py --out "$OUT" "${quick[@]}" "${rest[@]}"
status=$?
echo "gpu_bench: gpu_check exit $status, $(( $(date +%s) - t0 )) s wall; table $OUT/gpu_check.md, logs $OUT/all_logs.txt"
exit $status
