"""Running infra/start-servers.sh and infra/stop-servers.sh as a user does (the stack test
and the browser test share it)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).parents[2]


def run_script(name: str, env: dict, *args: str, timeout: float = 300) -> str:
    """``bash infra/<name> args...`` in ``env["GRPO_WORKDIR"]``; its stdout (it must succeed)."""
    proc = subprocess.run(
        ["bash", str(REPO / "infra" / name), *args],
        env=env,
        cwd=env["GRPO_WORKDIR"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout
