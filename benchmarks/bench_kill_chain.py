"""Processes and zombies sandboxed scorers leave behind under a PID 1 that does not reap.

    python benchmarks/bench_kill_chain.py [--calls 30] [--kills 40] [--max-delay 0.15]
        [--seed 0] [--paths code-fresh tool-fresh tool-warm] [--isolation bwrap namespaces]

Each arm runs tests/tools/reaping_driver.py as PID 1 of a pid namespace of its own
(``unshare --pid --fork --mount-proc``, as root or where user namespaces allow it), which
waits only for the scorer it started, as a container's entry point that does not reap would.
Per path (``code-fresh``: ``run_program`` with asserts; ``tool-fresh`` / ``tool-warm``: the
python tool on a fresh sandbox per call / on a warm server) and isolation:

- calls: a scorer runs ``--calls`` calls (every tenth one runs into its 1 s wall clock) and
  exits; zombies in the namespace while it still runs (after its calls) and once it exited,
  and what still runs then;
- kills: ``--kills`` scorers each start a call of a program that sleeps and are SIGKILLed at a
  random time up to ``--max-delay`` s after the call began (while the sandbox starts); a kill
  that leaves any process running in the namespace 2 s later is counted, and what it left is
  named. The zombies the killed scorers' sandboxes became are PID 1's to reap (nothing of a
  dead scorer can), counted apart.

Prints a Markdown table. Nothing outside an arm's namespace is looked at or signalled; the
kernel kills whatever is left in it when the arm's PID 1 exits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "tools" / "reaping_driver.py"


def arm(*args: str) -> dict:
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(DRIVER), *args]
    with tempfile.TemporaryDirectory() as tmp:  # what killed scorers leave, gone with it
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": tmp}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr.strip()[-300:]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--kills", type=int, default=40)
    ap.add_argument("--max-delay", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paths", nargs="+", default=["code-fresh", "tool-fresh", "tool-warm"])
    ap.add_argument("--isolation", nargs="+", default=["bwrap", "namespaces"])
    args = ap.parse_args()
    print("| path | isolation | calls | zombies during / after | left running | kills | "
          "kills leaving a process | what they left | zombies of killed scorers |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for path in args.paths:
        for iso in args.isolation:
            rng = random.Random(f"{args.seed}-{path}-{iso}")
            c = arm("calls", path, iso, str(args.calls)) if args.calls else {}
            trials = [["none", round(rng.uniform(0, args.max_delay), 4)]
                      for _ in range(args.kills)]  # fmt: skip
            k = arm("kills", path, iso, json.dumps(trials)) if args.kills else {}
            leaky = [left for _, _, left in k.get("trials", []) if left]
            names = Counter(name for left in leaky for name in left)
            left = ", ".join(f"{n} x{c}" for n, c in sorted(names.items())) or "-"
            running = ", ".join(c.get("alive_after", [])) or "0"
            err = " ".join(x["error"] for x in (c, k) if "error" in x)
            print(f"| {path} | {iso} | {args.calls} | {c.get('zombies_during')} / "
                  f"{c.get('zombies_after')} | {running} | {args.kills} | {len(leaky)} | "
                  f"{left} | {k.get('zombies')} |{err}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
