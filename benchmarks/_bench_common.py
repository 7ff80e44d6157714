"""What both sides of benchmarks/bench_vs_trl.py share: the config they read, thread
settings, the held-out evaluation of final weights, peak memory and the JSON hand-back; and
the timed ``grpo`` command of the benchmarks that run the CLI (bench_cluster, bench_rerun).

Each side runs in its own child process (``python benchmarks/_our_side.py ...``,
``python benchmarks/_trl_side.py ...``) so that its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout


def side_args(description: str) -> argparse.Namespace:
    """The arguments a side's child process takes (bench_vs_trl.py passes them)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", required=True, help="pipeline YAML preset")
    ap.add_argument("--set", action="append", default=[], help="config overrides")
    ap.add_argument("--start", required=True, help="start.json written by the start step")
    ap.add_argument("--run-dir", required=True, help="where this side writes its outputs")
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--threads", type=int, required=True, help="torch threads")
    ap.add_argument("--profile", help="our side: cProfile stats of the stage to this file")
    return ap.parse_args()


def load(config: str, overrides: list[str]):
    from flows.config import load_config

    return load_config(config, overrides)


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    torch.set_num_interop_threads(1)


def peak_rss_mib() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def heldout_accuracy(checkpoint_or_model, tokenizer, cfg, eval_path: str) -> dict:
    """Greedy pass@1 of the final weights on the run's eval rows (the first
    ``eval.num_examples`` when set), with the pipeline's own evaluator."""
    from grpo_core.algorithm.evaluation import evaluate
    from grpo_core.contracts.prompts import load_rows

    rows = load_rows(eval_path)
    if cfg.eval.num_examples:
        rows = rows[: cfg.eval.num_examples]
    model = checkpoint_or_model
    if isinstance(model, (str, Path)):
        from grpo_core.training.checkpoint import load_checkpoint

        model, tokenizer = load_checkpoint(model)
    model.eval()
    res = evaluate(
        model,
        tokenizer,
        rows,
        max_new_tokens=cfg.eval.max_completion_length,
        accuracy_reward=cfg.eval.accuracy_reward,
        format_reward=cfg.eval.format_reward,
        desc="bench eval",
    )
    return {"accuracy": res.accuracy, "format_rate": res.format_rate, "eval_rows": len(rows)}


def write_result(path: str, result: dict) -> None:
    """Write ``result`` as JSON under a temporary name, then rename it into place."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(target)


def timed_cli(
    workdir: Path, cli_args: list[str], sets: list[str], log: Path, env: dict | None = None
) -> tuple[float, str]:
    """``grpo <cli_args> --set S ...`` (``python -m flows.cli``, this checkout first on the
    path, ``env`` added) in ``workdir``: its wall seconds and output, which is also written
    to ``log``. Exits when the command fails."""
    cmd = [sys.executable, "-m", "flows.cli", *cli_args, *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        sys.exit(f"grpo run failed (rc {proc.returncode}); log: {log}")
    return wall, proc.stdout + proc.stderr
