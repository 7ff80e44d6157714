"""Time of the pre-flight check's refusals: every malformed-input case of
tests/pipeline/test_fail_fast.py and tests/tools/test_tool_preflight.py
(benchmarks/preflight_cases.py) run through the real ``grpo`` command, a fresh process
each, repeated; the goal is under 15 s a case, a dead tracking server included.

    python benchmarks/bench_preflight.py [--repeats 5] [--cases tools_ data_ ...]

Prints a Markdown table: case, exit code (2 when refused), median wall seconds over the
repeats, whether that is under 15 s, and whether the refusal was the expected one line
with nothing written (what the tests check). Run it on a quiet machine: everything here is
wall-clock time; the tests check no time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from benchmarks.preflight_cases import CASES, TOOL_CASES, problems, run_case  # noqa: E402
from benchmarks.preflight_inputs import write_inputs  # noqa: E402

GOAL_S = 15.0


def tiny_checkpoint(folder: Path) -> Path:
    """The tests' tiny checkpoint (tests/conftest.py): a 2-layer Qwen2 + char tokenizer."""
    from grpo_core.demo.model import save_base_model

    return save_base_model(folder / "tiny", seed=0, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64)  # fmt: skip


def time_case(case, inputs: dict, repeats: int) -> tuple[str, float, str]:
    """(exit codes, median seconds, what was wrong) of ``repeats`` runs of ``case``."""
    codes, seconds, wrong = [], [], []
    for _ in range(repeats):
        try:
            out = run_case(case, inputs)
        except subprocess.TimeoutExpired as e:
            codes.append("timeout")
            seconds.append(float(e.timeout))
            wrong.append("timed out")
            continue
        codes.append(str(out.returncode))
        seconds.append(out.seconds)
        wrong += problems(case, out)
    return "/".join(sorted(set(codes))), statistics.median(seconds), "; ".join(dict.fromkeys(wrong))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs per case (median taken)")
    ap.add_argument("--cases", nargs="*", default=[], help="only cases whose id starts so")
    args = ap.parse_args()
    cases = [
        c for c in [*CASES, *TOOL_CASES] if not args.cases or c[0].startswith(tuple(args.cases))
    ]
    if not cases:
        sys.exit(f"no case id starts with any of {args.cases}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        d = Path(tmp)
        (d / "inputs").mkdir()
        with write_inputs(d / "inputs", tiny_checkpoint(d)) as inputs:
            for i, case in enumerate(cases):
                code, median, wrong = time_case(case, inputs, args.repeats)
                rows.append((case[0], code, median, wrong))
                print(f"{i + 1}/{len(cases)} {case[0]}: {median:.1f} s", file=sys.stderr)

    print(f"\n`grpo` refusing malformed inputs: median of {args.repeats} run(s) per case\n")
    print(f"| case | exit code | median s | under {GOAL_S:.0f} s | refused as expected |")
    print("|---|---|---|---|---|")
    for name, code, median, wrong in rows:
        under = "yes" if median < GOAL_S else "**no**"
        print(f"| {name} | {code} | {median:.2f} | {under} | {wrong or 'yes'} |")
    slow = [r[0] for r in rows if r[2] >= GOAL_S]
    print(f"\n{len(rows) - len(slow)} of {len(rows)} cases under {GOAL_S:.0f} s"
          + (f"; slower: {', '.join(slow)}" if slow else ""))  # fmt: skip
    print(f"slowest: {max(rows, key=lambda r: r[2])[0]} {max(r[2] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
