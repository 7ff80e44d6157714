"""A stop request is never lost: a SIGTERM (or Ctrl-C) whose exception Python swallows, because
it landed in a ``__del__`` ("Exception ignored in: <function _SelectorTransport.__del__>", seen
under load during rl_1), is sent again and stops the run. Under our handler and under
Prefect's own (``capture_sigterm``, which raises ``TerminationSignal`` inside a flow run)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, signal, sys, threading, time
from flows import interrupts
from prefect.exceptions import TerminationSignal
from prefect.utilities.engine import capture_sigterm

interrupts.install()
signum = getattr(signal, sys.argv[1])
prefect = sys.argv[2] == "prefect"


class Slow:
    def __del__(self):
        time.sleep(0.3)  # the signal arrives here, where Python ignores exceptions


stopped = 0
for _ in range(20):
    threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
    try:
        with capture_sigterm() if prefect else open(os.devnull):
            Slow()
            time.sleep(2.0)  # a lost stop lets this finish
    except (TerminationSignal, interrupts.Interrupted, KeyboardInterrupt):
        stopped += 1
        signal.signal(signal.SIGTERM, interrupts._on_sigterm)
    time.sleep(0.2)  # no stray signal left for the next round
print("stopped", stopped, "of 20")
"""


@pytest.mark.parametrize(
    ("sig", "handler"), [("SIGTERM", "ours"), ("SIGTERM", "prefect"), ("SIGINT", "ours")]
)
def test_a_stop_raised_in_a_finaliser_is_sent_again(sig, handler):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, sig, handler],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.strip() == "stopped 20 of 20", (proc.stdout, proc.stderr[-2000:])
    assert "sending it again" in proc.stderr
