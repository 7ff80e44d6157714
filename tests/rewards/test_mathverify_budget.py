"""math-verify's answer checks are bounded by CPU time, not the wall clock: a machine busy
elsewhere (here: the scoring process stopped for longer than the old 5 s alarm) cannot turn
a right answer into a 0, and no alarm is left to go off later in unrelated code."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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


HOSTILE = textwrap.dedent(
    r"""
    import json, sys
    from grpo_core.rewards.accuracy import accuracy, math_verify_reward
    preds = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{\prod_{k=1}^{10^{9}} k}",
             r"\boxed{10^{10^{10}}}", r"\boxed{1e999999999}", r"\boxed{100000!}",
             r"\boxed{\int_0^{10^{10^{10}}} x^{x^{x}} dx}",
             r"\boxed{\sqrt{\sqrt{\sqrt{\sqrt{\sqrt{\sqrt{\sqrt{\sqrt{2}}}}}}}}}",
             r"\boxed{\frac{10}{2}}"]
    out = math_verify_reward(prompts=[""] * len(preds), completions=preds, answer=["5"] * 8)
    tags = [p.replace(r"\boxed{", "<answer>")[:-1] + "</answer>" for p in preds]
    acc = accuracy(prompts=[""] * len(tags), completions=tags, answer=["5"] * 8)
    print(json.dumps([list(out), out.errors, list(acc), acc.errors]))
    """
)


def test_answers_sympy_cannot_finish_score_0_with_their_error_in_bounded_time():
    """The answers of the trust audit (a tower, a product to 10^9, a huge exponent, a huge
    factorial, an integral, nested roots) are scored by both answer rewards well inside the
    test's own wall-clock limit: 0 with the reason, and a right answer beside them still 1."""
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HOSTILE], capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    for scores, errors in [json.loads(proc.stdout)[:2], json.loads(proc.stdout)[2:]]:
        assert scores == [0.0] * 7 + [1.0], (scores, errors)
        assert all(e and e.startswith("CheckFailed: ") for e in errors[:4]), errors
        assert errors[-1] is None
    assert time.monotonic() - t < 180


def test_a_check_killed_in_c_is_reported_and_the_next_check_gets_a_new_process():
    """The kernel's CPU limit ends a check stuck where no signal handler runs (SIGXCPU):
    the row's error says so, and the next check runs in a fresh child."""
    checker = mathverify._Checker()
    first = checker.ask({"op": "parses", "s": "x+1", "budget": 5.0})
    pid = checker.proc.pid
    limits = Path(f"/proc/{pid}/limits").read_text()
    cpu = next(line for line in limits.splitlines() if line.startswith("Max cpu time"))
    assert cpu.split()[3] != "unlimited"  # RLIMIT_CPU's soft limit is set per request
    mem = next(line for line in limits.splitlines() if line.startswith("Max address space"))
    assert int(mem.split()[3]) == mathverify.MEMORY_CAP
    assert first is True

    import threading

    result = {}

    def slow():
        try:
            checker.ask({"op": "verify", "pred": r"\prod_{k=1}^{10^{9}} k", "gold": "5",
                         "budget": 60.0})  # fmt: skip
        except mathverify.CheckFailed as e:
            result["error"] = str(e)

    th = threading.Thread(target=slow)
    th.start()
    time.sleep(1.0)
    import os

    os.kill(pid, signal.SIGXCPU)  # what the kernel sends at the limit
    th.join(30)
    assert "over its CPU budget (SIGXCPU)" in result["error"]
    assert checker.ask({"op": "verify", "pred": "5", "gold": "5", "budget": 5.0}) is True
    assert checker.proc.pid != pid
    checker._stop()


def test_huge_numbers_are_refused_before_sympy_and_small_ones_are_not():
    for s in [r"9^{9^{9^{9}}}", r"10^{10^{10}}", r"2^{10000000}", "5000!", "1e99999999"]:
        assert mathverify.too_costly(s), s
    for s in [r"2^{100}", r"e^{x^{2}}", "20!", r"\frac{1}{2}", "1e-3", r"3 \times 10^{8}"]:
        assert mathverify.too_costly(s) is None, s
