"""Two machines, one S3 bucket: `grpo run` on node A with ``storage.url: s3://...`` (a real
S3-compatible server on localhost: moto's, through s3fs), then on node B with an empty
output folder. B downloads and verifies every finished stage instead of recomputing it,
and reports the same results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def s3_endpoint(monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("grpo-runs")
    yield endpoint
    server.stop()


def _grpo_run(node: Path, endpoint: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_HOME"))}
    env.update(CREDENTIALS, PREFECT_HOME=str(node / "prefect-home"), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "flows.cli", "run"]
    cmd += [a for o in TINY_OVERRIDES for a in ("--set", o)]
    cmd += ["--set", f"output_dir={node / 'runs'}", "--set", "run_name=twonodes"]
    cmd += ["--set", "storage.url=s3://grpo-runs/team"]
    cmd += ["--set", f"storage.options={{endpoint_url: '{endpoint}'}}"]
    node.mkdir(exist_ok=True)
    proc = subprocess.run(cmd, env=env, cwd=node, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out
    return out


def _summary_rows(log: str) -> list[list[str]]:
    """The summary table's rows (stage, accuracy, format rate, mean length), no wall time."""
    rows = [line.split("│")[1:-2] for line in log.splitlines() if line.startswith("│")]
    return [[cell.strip() for cell in row] for row in rows]


@pytest.mark.slow
def test_node_b_reuses_every_stage_node_a_put_in_the_bucket(tmp_path, s3_endpoint):
    import s3fs

    first = _grpo_run(tmp_path / "node_a", s3_endpoint)
    bucket = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    names = [f.removeprefix("grpo-runs/team/twonodes/") for f in bucket.find("grpo-runs/team")]
    assert "checkpoints/cold_start_sft.stage.json" in names
    assert "checkpoints/base/model.safetensors" in names
    assert "checkpoints/rl_2/model.safetensors" in names
    for it in (0, 1):
        for f in ("rollouts.parquet", "scored.parquet", "policy.json", "policy.json.stage.json"):
            assert f"rl_1/iter_{it:04d}/{f}" in names
    # the stage's last iteration is a save point: its checkpoint, written in the background
    assert "rl_1/iter_0001/checkpoint/model.safetensors" in names

    node_b = tmp_path / "node_b"
    second = _grpo_run(node_b, s3_endpoint)
    for stage in ("cold_start_sft", "rejection_sampling", "re_sft"):
        assert f"{stage}: inputs unchanged" in second
    assert "rl_1: 2 of 2 iterations reused from cache" in second
    assert "rl_2: 1 of 1 iterations reused from cache" in second
    assert "pulled" in second
    run_b = node_b / "runs" / "twonodes"
    assert (run_b / "checkpoints" / "rl_2" / "model.safetensors").is_file()
    assert (run_b / "rl_1" / "iter_0001" / "scored.parquet").is_file()
    assert _summary_rows(first) and _summary_rows(first) == _summary_rows(second)
    run_a = tmp_path / "node_a" / "runs" / "twonodes"
    for stage in ("cold_start_sft", "rl_1", "re_sft", "rl_2"):  # the same eval tables
        table = Path("eval") / f"{stage}.parquet"
        assert (run_b / table).read_bytes() == (run_a / table).read_bytes()
