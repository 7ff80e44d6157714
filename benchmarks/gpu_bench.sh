#!/usr/bin/env bash
# One short GPU run of benchmarks/bench_rollout.py (hf vs vllm, bf16, both model sizes).
# Run from the repository root on a GPU machine:   bash benchmarks/gpu_bench.sh
# Uses vLLM when `python3 -c "import vllm"` already works; otherwise installs `vllm` into
# a venv ($GPU_BENCH_VENV, default /tmp/vllm-gpu-venv). On a machine with no package
# registry the install fails and the hf rows are still measured. Under 8 minutes: the
# install takes ~2-4 min with a warm network, the benchmark ~2 min.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

PY=python3
if ! "$PY" -c "import vllm" 2>/dev/null; then
  VENV=${GPU_BENCH_VENV:-/tmp/vllm-gpu-venv}
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  if timeout 300 "$VENV/bin/pip" install -q "vllm==0.32.*"; then
    PY="$VENV/bin/python"
  else
    echo "gpu_bench: could not install vllm here; measuring the hf engine only" >&2
  fi
fi
# grpo_core's own needs next to whatever torch/transformers that python has
"$PY" -m pip install -q --no-deps -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import pyarrow, tqdm" 2>/dev/null || "$PY" -m pip install -q pyarrow tqdm || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

engines=hf,vllm
"$PY" -c "import vllm" 2>/dev/null || engines=hf
timeout 360 "$PY" benchmarks/bench_rollout.py --device cuda --engines "$engines" \
  --prompts 256 --big-divisor 1 --n 8 --max-new-tokens 256 \
  --hf-dtype bfloat16 --vllm-dtypes bfloat16 --hf-batch 2048 \
  --max-num-seqs 512 --gpu-memory-utilization 0.3 \
  --out "$OUT/bench_rollout_gpu.md" 2>"$OUT/bench_rollout_gpu.log"
status=$?
cat "$OUT/bench_rollout_gpu.md" 2>/dev/null || tail -40 "$OUT/bench_rollout_gpu.log"
exit $status
