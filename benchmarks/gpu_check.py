"""The GPU check: every training path of the pipeline on one GPU, in a few minutes, one table.

    bash benchmarks/gpu_bench.sh [--wheelhouse DIR] [--quick]   # installs what lacks, runs this
    python benchmarks/gpu_check.py [--out DIR] [--legs LEG ...] [--jobs N] [--quick] [--plan]

Each ``grpo run`` leg is the whole recipe (prepare, cold-start SFT, rl_1 with held-out evals,
rejection sampling, re-SFT, rl_2, the final eval) on the embedded demo (configs/demo.yaml: a
1M-parameter Qwen2 and 3-digit additions, offline) at a tiny budget, ``model.device=auto``,
with the leg's settings:

- ``fp32``: as shipped; ``bf16``: ``rl.bf16`` + ``sft.bf16`` (autocast, float32 master
  weights); ``fp16``: ``rl.fp16`` + ``sft.fp16`` (autocast with a GradScaler; CUDA only);
- ``lora``: ``model.lora`` (r 8, alpha 16); ``qlora``: the same on 4-bit NF4 base weights
  (``model.load_in_4bit``; CUDA and bitsandbytes only);
- ``grad-ckpt``: ``model.gradient_checkpointing``; ``token-budget``: SFT and RL micro-batches
  cut into chunks of at most 256 padded tokens (``*.max_tokens_per_microbatch``);
- ``async-1`` / ``async-2``: ``rl.async_level`` 1 and 2 (the engine in a process of its own,
  on the same GPU, sampling with a policy 1 or 2 updates behind);
- ``vllm-fp32-sync``, ``vllm-bf16-offload`` (optimizer offload: AdamW's state in CPU memory
  while vLLM generates), ``lora-vllm``, ``lora-vllm-adapter``: vLLM rollouts colocated
  (skipped with a line when vllm does not import).

Other legs: ``fsdp-1gpu`` / ``fsdp-2gpu``: ``torch.distributed.run --standalone -m
flows.ddp_update --strategy fsdp`` (FSDP2, gradient checkpointing, bf16) on a scored file of
the ``fp32`` leg, one rank, and two (skipped with fewer than 2 GPUs); ``cuda-tests``: ``pytest
tests/gpu`` (optimizer offload moves and restores AdamW's moments); ``probe-0.4b`` and
``vs-trl-0.4b``: benchmarks/gpu_probe.py (generation and update throughput at Qwen2.5-0.5B's
shape and the share of the GPU's bf16 peak; our RL loop against TRL's GRPOTrainer, HF
generation on both sides).

Independent legs run ``--jobs`` at a time on the GPU, each under ``--timeout`` seconds with
its log in ``OUT/<leg>.log``; the table (leg, exit status, wall s, peak GiB, rollout and
update tokens/s, share of bf16 peak) goes to stdout, ``OUT/gpu_check.md`` and ``.json``, and
the last lines of every log to ``OUT/all_logs.txt``. ``--quick``: the smallest budgets, a
toy probe, for a CPU dry run (CUDA-only legs print why they skip). Exit status 1 when a leg
failed (a skip is not a failure).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/demo.yaml"
# the whole recipe at a tiny budget: every stage runs, the held-out evals included
BUDGET = [
    "model.device=auto",
    "data.demo.n_sft=256", "data.demo.n_rl=1024", "data.demo.n_dev=32", "data.demo.n_eval=32",
    "sft.max_steps=40", "sft.min_steps=0", "sft.target_accuracy=null", "sft.eval_every=1000",
    "sft.checkpoint_every=0",
    "rl.iterations=2", "rl.prompts_per_iteration=16", "rl.num_generations=4",
    "rl.steps_per_generation=2", "rl.eval_every=1",
    "rejection_sampling.num_prompts=32", "rejection_sampling.require=[]",
    "re_sft.max_steps=5", "rl_2.iterations=2", "eval.num_examples=32",
]  # fmt: skip
QUICK = ["sft.max_steps=10", "rl.prompts_per_iteration=8", "eval.num_examples=16",
         "rejection_sampling.num_prompts=16"]  # fmt: skip
LORA = ["model.lora={r: 8, alpha: 16}", "rl.learning_rate=1.0e-3"]
VLLM = ["rollout.engine=vllm", "rollout.vllm.max_model_len=256", "rollout.vllm.enforce_eager=true",
        "rollout.vllm.gpu_memory_utilization=0.1"]  # fmt: skip
LEGS = {
    "fp32": [],
    "bf16": ["rl.bf16=true", "sft.bf16=true"],
    "fp16": ["rl.fp16=true", "sft.fp16=true"],
    "lora": LORA,
    "qlora": [*LORA, "model.load_in_4bit=true"],
    "grad-ckpt": ["model.gradient_checkpointing=true"],
    "token-budget": ["rl.max_tokens_per_microbatch=256", "sft.max_tokens_per_microbatch=256"],
    "async-1": ["rl.async_level=1"],
    "async-2": ["rl.async_level=2"],
    "vllm-fp32-sync": [*VLLM, "rollout.vllm.dtype=float32", "rollout.check_sync=true"],
    "vllm-bf16-offload": [
        *VLLM, "rollout.vllm.dtype=bfloat16", "rollout.vllm.enable_sleep_mode=true",
        "rollout.vllm.offload_optimizer=true", "rl.bf16=true", "sft.bf16=true",
    ],
    "lora-vllm": [*VLLM, *LORA, "rollout.vllm.dtype=bfloat16"],
    "lora-vllm-adapter": [*VLLM, *LORA, "rollout.vllm.dtype=bfloat16",
                          "rollout.vllm.lora_sync=adapter"],
}  # fmt: skip
CUDA_ONLY = {"fp16", "qlora"}
OTHER = ["fsdp-1gpu", "fsdp-2gpu", "cuda-tests", "probe-0.4b", "vs-trl-0.4b"]
AFTER = {"fsdp-1gpu": "fp32", "fsdp-2gpu": "fp32"}  # reads a scored file of that leg
TAIL_LINES = 60


def run_overrides(leg: str, out: Path, quick: bool = False) -> list[str]:
    """Every ``--set`` of one `grpo run` leg."""
    where = [f"run_name={leg}", f"output_dir={out / leg}", f"tracking.uri=sqlite:///{out / leg}.db"]
    return [*where, *BUDGET, *(QUICK if quick else []), *LEGS[leg]]


def _imports(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_reason(leg: str) -> str | None:
    """Why ``leg`` cannot run on this machine, or None."""
    gpus = _gpus()
    if leg in CUDA_ONLY and not gpus:
        return "skipped: no CUDA"
    if leg == "qlora" and not _imports("bitsandbytes"):
        return "skipped: bitsandbytes does not import"
    if "vllm" in leg and not _imports("vllm"):
        return "skipped: vllm does not import"
    if leg == "fsdp-2gpu" and gpus < 2:
        return f"skipped: {gpus} GPU(s), needs 2"
    if leg == "vs-trl-0.4b" and not _imports("trl"):
        return "skipped: trl does not import"
    return None


def _run(cmd: list[str], log: Path, timeout: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO)]
        ),
    }
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                cwd=REPO, env=env).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
            f.write(f"\ngpu_check: timed out after {timeout} s\n")
    return rc, time.perf_counter() - t0


def stage_numbers(db: Path) -> dict[str, dict]:
    """From a leg's MLflow store, per stage run: peak GiB, rollout tok/s, update s/iteration,
    and update tok/s (completion tokens trained per update second)."""
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
            rid = run.info.run_id
            row = {
                "peak_gib": max(peak) if peak else None,
                "rollout_tok_s": _mean(client, rid, "train/rollout/tokens_per_s"),
                "update_s": _mean(client, rid, "train/timing/update_s"),
            }
            lengths = _mean(client, rid, "train/completions/mean_length")
            per_iter = _param(run, "prompts_per_iteration", "num_generations")
            if lengths and per_iter and row["update_s"]:
                row["update_tok_s"] = lengths * per_iter / row["update_s"]
            out[name] = row
    return out


def _param(run, *keys: str) -> float | None:
    """The product of numeric run params (the stage's config as logged), None if absent."""
    p = run.data.params
    try:
        values = [float(p[k]) for k in keys]
    except (KeyError, ValueError):
        return None
    n = 1.0
    for v in values:
        n *= v
    return n


def _mean(client, run_id: str, key: str) -> float | None:
    values = [p.value for p in client.get_metric_history(run_id, key)]
    return sum(values) / len(values) if values else None


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


class Check:
    def __init__(self, out: Path, timeout: int, quick: bool):
        self.out, self.timeout, self.quick = out, timeout, quick
        self.done: dict[str, threading.Event] = {}

    def leg(self, leg: str) -> list[dict]:
        reason = skip_reason(leg)
        if reason:
            (self.out / f"{leg}.log").write_text(reason + "\n")
            print(f"gpu_check: {leg}: {reason}", flush=True)
            return [{"leg": leg, "stage": reason, "rc": None}]
        if leg in AFTER and AFTER[leg] in self.done:
            self.done[AFTER[leg]].wait()
        print(f"gpu_check: {leg} ...", flush=True)
        try:
            if leg in LEGS:
                rows = self.grpo_leg(leg)
            elif leg.startswith("fsdp-"):
                rows = self.fsdp_leg(leg, 1 if leg == "fsdp-1gpu" else 2)
            elif leg == "cuda-tests":
                cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu",
                       "tests/engines/test_static_decode.py"]  # fmt: skip
                rc, wall = _run(cmd, self.out / f"{leg}.log", self.timeout)
                rows = [
                    {
                        "leg": leg,
                        "stage": "pytest tests/gpu + static decode",
                        "rc": rc,
                        "wall_s": wall,
                    }
                ]
            else:
                rows = self.probe_leg(leg)
        finally:
            if leg in self.done:
                self.done[leg].set()
        print(f"gpu_check: {leg}: exit {rows[0].get('rc')}, {rows[0].get('wall_s', 0):.0f} s",
              flush=True)  # fmt: skip
        return rows

    def grpo_leg(self, leg: str) -> list[dict]:
        cmd = [sys.executable, "-m", "flows.cli", "run", "--config", CONFIG]
        for o in run_overrides(leg, self.out, self.quick):
            cmd += ["--set", o]
        rc, wall = _run(cmd, self.out / f"{leg}.log", self.timeout)
        db = self.out / f"{leg}.db"
        numbers = {}
        if db.exists():
            try:
                numbers = stage_numbers(db)
            except Exception as e:  # the table must come out whatever a leg left behind
                print(f"gpu_check: {leg}: could not read {db}: {e}", flush=True)
        rows = [{"leg": leg, "stage": "(all)", "rc": rc, "wall_s": wall}]
        rows += [{"leg": leg, "stage": s, **v} for s, v in sorted(numbers.items())]
        return rows

    def fsdp_leg(self, leg: str, ranks: int) -> list[dict]:
        src = self.out / AFTER[leg]
        scored = sorted(src.rglob("rl_1/iter_*/scored.parquet")) or sorted(
            src.rglob("scored.parquet")
        )
        policy = sorted(src.rglob("checkpoints/cold_start_sft"))
        if not scored or not policy:
            return [{"leg": leg, "stage": f"failed: no scored file / checkpoint in {src}", "rc": 1}]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(ranks), "-m", "flows.ddp_update", "--strategy", "fsdp",
               "--policy", str(policy[0]), "--scored", str(scored[-1]),
               "--out", str(self.out / f"{leg}-update"), "--config", CONFIG,
               "--set", f"output_dir={self.out / leg}", "--set", "model.gradient_checkpointing=true",
               "--set", "rl.steps_per_generation=2"]  # fmt: skip
        if _gpus():
            cmd += ["--set", "rl.bf16=true", "--set", "rl.optim=adamw_torch_fused"]
        rc, wall = _run(cmd, self.out / f"{leg}.log", self.timeout)
        row = {"leg": leg, "stage": "update", "rc": rc, "wall_s": wall}
        if rc == 0:
            try:
                lines = (self.out / f"{leg}.log").read_text().strip().splitlines()
                summary = json.loads(lines[-1])
                row["stage"] = f"update ({summary['steps']} steps, world {summary['world_size']})"
            except (ValueError, KeyError, IndexError):
                pass
        return [row]

    def probe_leg(self, leg: str) -> list[dict]:
        what = "probe" if leg == "probe-0.4b" else "vs-trl"
        result = self.out / f"{leg}.json"
        cmd = [sys.executable, "benchmarks/gpu_probe.py", what, "--out", str(result)]
        rc, wall = _run(cmd + (["--quick"] if self.quick else []), self.out / f"{leg}.log",
                        self.timeout)  # fmt: skip
        rows = [{"leg": leg, "stage": "(all)", "rc": rc, "wall_s": wall}]
        if rc == 0 and result.exists():
            for r in json.loads(result.read_text()):
                stage = r.get("side") or r["kind"]
                if r.get("wall_vs_ours"):
                    stage += f" (wall {r['wall_vs_ours']:.2f}x ours)"
                if r["kind"] == "vs-trl":
                    r["update_tok_s"] = r["completion_tokens"] / max(r["update_s"], 1e-9)
                    r["rollout_tok_s"] = r["completion_tokens"] / max(r["generation_s"], 1e-9)
                rows.append({"leg": leg, "stage": stage, "wall_s": r.get("wall_s", r.get("seconds")),
                             **{k: r.get(k) for k in ("peak_gib", "rollout_tok_s", "update_tok_s",
                                                      "bf16_share")}})  # fmt: skip
        return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| leg | stage | exit | wall s | peak GiB | rollout tok/s | update tok/s | share of bf16 peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = r.get("bf16_share")
        lines.append(
            f"| {r['leg']} | {r['stage']} | {_fmt(r.get('rc'), 'd')} | {_fmt(r.get('wall_s'))} "
            f"| {_fmt(r.get('peak_gib'), '.2f')} | {_fmt(r.get('rollout_tok_s'), '.0f')} "
            f"| {_fmt(r.get('update_tok_s'), '.0f')} "
            f"| {'-' if share is None else f'{100 * share:.1f}%'} |"
        )
    return "\n".join(lines)


def all_logs(out: Path, legs: list[str], lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of every leg's log, one file to read a failure from."""
    parts = []
    for leg in legs:
        log = out / f"{leg}.log"
        text = log.read_text(errors="replace").replace("\r", "\n") if log.exists() else "(no log)"
        tail = [x for x in text.splitlines() if x.strip()][-lines:]
        parts.append(
            f"===== {leg} (last {len(tail)} lines of {log.name}) =====\n" + "\n".join(tail)
        )
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out/gpu_check"))
    ap.add_argument("--legs", nargs="*", default=[*LEGS, *OTHER])
    ap.add_argument("--jobs", type=int, default=4, help="legs at a time")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per leg")
    ap.add_argument("--quick", action="store_true", help="smallest budgets: a CPU dry run")
    ap.add_argument("--plan", action="store_true", help="print the legs' settings and exit")
    args = ap.parse_args(argv)
    unknown = [g for g in args.legs if g not in LEGS and g not in OTHER]
    if unknown:
        ap.error(f"unknown legs {unknown}; known: {[*LEGS, *OTHER]}")
    out = Path(args.out).resolve()
    if args.plan:
        for leg in args.legs:
            if leg in LEGS:
                print(leg, " ".join(run_overrides(leg, out, args.quick)))
            else:
                print(leg, f"(after {AFTER[leg]})" if leg in AFTER else "")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    print(f"gpu_check: torch {torch.__version__}, {gpu}, {len(args.legs)} legs, "
          f"{args.jobs} at a time, {args.timeout} s each", flush=True)  # fmt: skip
    check = Check(out, args.timeout, args.quick)
    check.done = {AFTER[g]: threading.Event() for g in args.legs if g in AFTER}
    t0 = time.perf_counter()
    # the legs others wait for first, the waiting ones last: no slot idles on a wait
    order = sorted(args.legs, key=lambda g: (g not in check.done, g in AFTER))
    results: dict[str, list[dict]] = {}
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(check.leg, g): g for g in order}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            done = [r for leg in args.legs for r in results.get(leg, [])]
            (out / "gpu_check.md").write_text(f"(partial: {len(results)} legs)\n\n{table(done)}\n")
    rows = [r for leg in args.legs for r in results[leg]]
    text = table(rows)
    head = f"GPU check: torch {torch.__version__}, {gpu}; {time.perf_counter() - t0:.0f} s wall"
    print("\n" + head + "\n\n" + text)
    (out / "gpu_check.md").write_text(head + "\n\n" + text + "\n")
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    (out / "all_logs.txt").write_text(all_logs(out, args.legs))
    failed = [r["leg"] for r in rows if r.get("rc") not in (0, None)]
    if failed:
        print(f"gpu_check: failed: {' '.join(dict.fromkeys(failed))} (logs: {out}/all_logs.txt)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
