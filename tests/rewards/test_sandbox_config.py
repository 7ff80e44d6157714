"""``sandbox.isolation``: a pipeline setting that reaches the code rewards of every stage, is
logged with the RL stage's parameters and recorded in the scored file's metadata."""

import json
import typing

import pyarrow.parquet as pq
import pytest

from flows.config import PipelineConfig, SandboxConfig
from grpo_core import rewards
from grpo_core.contracts.io import write_parquet
from grpo_core.sandbox import isolation, launcher
from grpo_core.sandbox.isolation import ISOLATION_ENV, MODES, SandboxUnavailable


def test_setting_names_the_modes():
    assert typing.get_args(SandboxConfig.model_fields["isolation"].annotation) == MODES
    with pytest.raises(ValueError, match="isolation"):
        PipelineConfig(sandbox={"isolation": "unshare"})


def test_setting_reaches_the_code_rewards(monkeypatch, tmp_path):
    """The run context (flows/run_context.py) hands the setting to the code rewards of this
    process and of those it starts; loading a config alone changes nothing."""
    from flows.run_context import RunContext

    monkeypatch.setenv(ISOLATION_ENV, "auto")  # restored (to unset) after the test
    monkeypatch.delenv(ISOLATION_ENV)
    RunContext.open(PipelineConfig(output_dir=str(tmp_path)))  # not set: env (or auto) decides
    assert isolation.requested_isolation() == "auto"
    cfg = PipelineConfig(sandbox={"isolation": "none"}, output_dir=str(tmp_path))
    assert isolation.requested_isolation() == "auto"
    RunContext.open(cfg)
    assert isolation.requested_isolation() == "none"
    assert rewards.sandbox_params({"code_tests": 1.0}) == {
        "isolation": "none",
        "mode": "none (rlimits only, NOT isolated; requested none)",
    }
    assert rewards.sandbox_params({"accuracy": 1.0}) == {"isolation": "none", "mode": "unused"}


def _rollouts(path):
    import pyarrow as pa

    from grpo_core.contracts.rollouts import prompt_hash, with_metadata

    records = [
        {
            "prompt_id": prompt_hash("p"),
            "group_idx": 0,
            "sample_idx": i,
            "prompt": "p",
            "prompt_text": "p",
            "completion": f"def f():\n    return {i + 1}\n",
            "prompt_ids": [1, 2],
            "completion_ids": [3, 4],
            "completion_logprobs": [-0.5, -0.5],
            "completion_length": 2,
            "finish_reason": "stop",
            "policy_id": "test",
            "iteration": 0,
            "test_list": ["assert f() == 1"],
        }
        for i in range(2)
    ]
    table = with_metadata(pa.Table.from_pylist(records), {"kind": "rollouts"})
    write_parquet(table, str(path))


def test_score_file_fails_closed_and_records_the_isolation(tmp_path, monkeypatch):
    pytest.importorskip("prefect")
    from tasks.score import score_file

    monkeypatch.delenv(ISOLATION_ENV, raising=False)

    src = tmp_path / "rollouts.parquet"
    _rollouts(src)
    out = score_file(str(src), str(tmp_path / "scored.parquet"), {"code_tests": 1.0})
    assert out.metrics["rewards/code_tests/mean"] == pytest.approx(0.5)
    meta = pq.read_schema(out.path).metadata or {}
    text = " ".join(v.decode() for v in meta.values())
    assert "sandbox" in text and json.dumps(rewards.isolation_label(["code_tests"]))[1:-1] in text

    fail = "import os\nos.write(2, b'sandbox setup failed: unshare: Operation not permitted\\n')\n"
    monkeypatch.setattr(launcher, "_NSINIT", fail + "os._exit(125)\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap either
    isolation._detect.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="install bubblewrap"):
            score_file(str(src), str(tmp_path / "refused.parquet"), {"code_tests": 1.0})
        assert not (tmp_path / "refused.parquet").exists()
    finally:
        isolation._detect.cache_clear()
