"""The servers bind loopback unless told otherwise (issue 44): a bad GRPO_AUTH is refused
before anything starts (tests/infra/test_server_auth.py runs the servers with passwords), and
the Ray head script no longer defaults to 0.0.0.0."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

INFRA = Path(__file__).resolve().parents[2] / "infra"


@pytest.mark.parametrize("auth", ["alice", "alice:short", ":a-long-enough-password"])
def test_a_bad_grpo_auth_is_refused_before_anything_starts(tmp_path, auth):
    state = tmp_path / "state"
    env = {**os.environ, "GRPO_AUTH": auth, "GRPO_STATE_DIR": str(state)}
    proc = subprocess.run(["bash", str(INFRA / "start-servers.sh"), "prefect"], env=env,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "USER:PASSWORD" in proc.stderr and "12 characters" in proc.stderr
    assert not state.exists()  # nothing written, nothing started


def test_the_ray_head_defaults_to_loopback():
    script = (INFRA / "ray" / "head-worker.sh").read_text()
    assert 'GRPO_HOST="${GRPO_HOST:-127.0.0.1}"' in script
    assert "0.0.0.0" not in script.split("set -euo pipefail", 1)[1]
