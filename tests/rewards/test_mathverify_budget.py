"""math-verify's answer checks are bounded by CPU time, not the wall clock: a machine busy
elsewhere (here: the scoring process stopped for longer than the old 5 s alarm) cannot turn
a right answer into a 0, and no alarm is left to go off later in unrelated code."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from grpo_core.rewards import mathverify

pytestmark = pytest.mark.skipif(not mathverify.available(), reason="math-verify not installed")


def test_the_budget_counts_cpu_time_not_waiting():
    with mathverify.cpu_budget(0.3):
        time.sleep(0.6)  # waiting: no CPU spent, no exception
    with pytest.raises(mathverify.OverBudget), mathverify.cpu_budget(0.2):
        while True:
            pass
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGPROF) in (signal.SIG_DFL, None)


SCORER = textwrap.dedent(
    r"""
    import sys
    from grpo_core.rewards.accuracy import math_verify_reward as reward
    print("ready", flush=True)
    sys.stdin.readline()
    n = 600  # ~15 ms each: the symbolic comparison dominates
    gold = [f"(x+{i})^{{3}}(x+{i})^{{3}}" for i in range(n)]
    preds = [f"\\boxed{{(x+{i})^{{6}}}}" for i in range(n)]
    scores = reward(prompts=[""] * n, completions=preds, answer=gold)
    print(sum(s == 1.0 for s in scores), n, flush=True)
    """
)


def test_a_right_answer_scores_1_when_the_machine_stalls_the_scorer():
    proc = subprocess.Popen([sys.executable, "-c", SCORER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    proc.stdin.write("go\n")
    proc.stdin.flush()
    time.sleep(2.0)  # inside the comparisons (600 take ~9 s)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(6.0)  # longer than math-verify's own 5 s wall-clock alarm
    proc.send_signal(signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    right, n = map(int, out.split())
    assert right == n
