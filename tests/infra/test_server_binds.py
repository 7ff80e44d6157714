"""The servers bind loopback unless told otherwise (issue 44): neither Prefect nor MLflow
authenticates, so infra/start-servers.sh refuses another bind address without
GRPO_EXPOSE_UNAUTHENTICATED=1, writing nothing, and the Ray head script no longer defaults to
0.0.0.0."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

INFRA = Path(__file__).resolve().parents[2] / "infra"


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_a_non_loopback_bind_is_refused_without_the_opt_in(tmp_path, host):
    state = tmp_path / "state"
    env = {**os.environ, "GRPO_HOST": host, "GRPO_STATE_DIR": str(state)}
    env.pop("GRPO_EXPOSE_UNAUTHENTICATED", None)
    proc = subprocess.run(["bash", str(INFRA / "start-servers.sh"), "prefect"], env=env,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "authenticate no one" in proc.stderr and "GRPO_EXPOSE_UNAUTHENTICATED=1" in proc.stderr
    assert not state.exists()  # nothing written, nothing started


def test_the_ray_head_defaults_to_loopback():
    script = (INFRA / "ray" / "head-worker.sh").read_text()
    assert 'GRPO_HOST="${GRPO_HOST:-127.0.0.1}"' in script
    assert "0.0.0.0" not in script.split("set -euo pipefail", 1)[1]
