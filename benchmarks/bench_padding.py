"""The padding share of the GRPO update's token grid, from a finished run's scored files.

Each optimizer micro-batch is forwarded as one padded grid: its rows x (longest prompt +
longest completion among them), after the columns that are padding in every row are trimmed
(grpo_core/contracts/batch.py: ``UpdateBatch.trimmed``). With ``skip_zero_advantage`` only the
rows with a non-zero advantage are forwarded (grpo_core/algorithm/micro_batch.py:
``live_rows``). This reads every ``<stage>/iter_NNNN/scored.parquet`` of a run folder, splits
each iteration's rows into the micro-batches the update makes (the stage's settings, from the
config given), and prints the share of grid cells that are padding, for all rows and for the
trained rows; above about 15%, packing sequences (verl, OpenRLHF) would pay.

    python benchmarks/bench_padding.py runs/demo --config configs/demo.yaml
    python benchmarks/bench_padding.py runs/demo-tools --config configs/demo-tools.yaml
"""

from __future__ import annotations

import argparse
from pathlib import Path


def grid_counts(scored: Path, rl) -> dict[str, int]:
    """``{"grid", "real", "trained_grid", "trained_real"}`` cells of one scored file's update."""
    from grpo_core.algorithm.micro_batch import live_rows
    from grpo_core.algorithm.scored_batch import ScoredRows
    from grpo_core.algorithm.update import _accumulation_plan

    rows = ScoredRows.read(str(scored), dynamic_sampling=rl.dynamic_sampling)
    out = {"grid": 0, "real": 0, "trained_grid": 0, "trained_real": 0}
    if not rows.keep:
        return out
    batch = rows.batch(0, mask_truncated=rl.mask_truncated_completions, sampling_logprobs=False)
    n_groups = len(set(batch.group_ids.tolist()))
    micro, _ = _accumulation_plan(rl.update_config(), n_groups)
    for idx in batch.step_slices(micro):
        mb = batch.slice(idx)
        for key, part in (("", mb), ("trained_", mb.slice(live_rows(mb).nonzero().squeeze(-1)))):
            if part.size == 0:
                continue
            t = part.trimmed()
            out[key + "grid"] += t.size * t.input_ids.shape[1]
            out[key + "real"] += int(t.attention_mask.sum())
    return out


def measure(run: Path, rl, rl_2) -> list[tuple[str, int, float, float]]:
    """``(stage, iterations, padding share of all rows, of trained rows)`` per RL stage."""
    table = []
    for stage, cfg in (("rl_1", rl), ("rl_2", rl_2)):
        files = sorted((run / stage).glob("iter_*/scored.parquet"))
        if not files:
            continue
        total = {"grid": 0, "real": 0, "trained_grid": 0, "trained_real": 0}
        for f in files:
            for k, v in grid_counts(f, cfg).items():
                total[k] += v
        share = 1 - total["real"] / max(1, total["grid"])
        trained = 1 - total["trained_real"] / max(1, total["trained_grid"])
        table.append((stage, len(files), share, trained))
    return table


def main() -> None:
    from flows.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (output_dir/run_name)")
    ap.add_argument("--config", default=None, help="the runs' preset (their rl settings)")
    ap.add_argument("--set", action="append", default=[], help="the runs' overrides")
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    print("| run | stage | iterations | padding (all rows) | padding (trained rows) |")
    print("|---|---|---|---|---|")
    for run in args.runs:
        for stage, n, share, trained in measure(run, cfg.rl, cfg.rl_2_config()):
            print(f"| {run.name} | {stage} | {n} | {share:.1%} | {trained:.1%} |")


if __name__ == "__main__":
    main()
