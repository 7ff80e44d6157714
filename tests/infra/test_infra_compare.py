"""`grpo compare` and the model registry on runs logged the way the pipeline logs them
(tasks/tracking.Tracking: a parent run tagged pipeline=r1 with `<stage>/eval/*` metrics, one
child run per stage, RL children with `reward` and `iteration` per iteration)."""

from __future__ import annotations

import pytest
from rich.console import Console

from flows.compare import compare, main
from flows.config import CHECKPOINT_STAGES
from flows.model_registry import register_final_checkpoint
from tasks.tracking.stages import Tracking

ACC = dict(zip(CHECKPOINT_STAGES, (0.35, 0.76, 0.90, 0.95), strict=True))


def _log_pipeline(uri: str, name: str, shift: float = 0.0) -> str:
    t = Tracking.open(uri, "grpo-compare-test").start_parent(name, {"pipeline": "r1"})
    p = t.parent_run_id
    for stage, acc in ACC.items():
        t.log_metrics(
            p,
            {
                f"{stage}/eval/accuracy": acc + shift,
                f"{stage}/eval/format_rate": 1.0,
                f"{stage}/eval/mean_length": 29.0,
            },
        )
        child = t.start_child(stage)
        if stage.startswith("rl"):
            for it in range(3):  # per-step metrics in between, as the update logs them
                t.log_metrics(child, {"loss": 0.1}, 2 * it + 1)
                t.log_metrics(child, {"reward": acc - 0.2 + 0.1 * it, "iteration": it}, 2 * it + 2)
        t.log_metrics(child, {"wall_time_s": 40.0}, 10)
        t.end(child)
    t.log_metrics(p, {"total_time_s": 200.0})
    t.end(p)
    return p


def _console() -> Console:
    return Console(record=True, width=160)


def test_compare_latest_run_table_plot_and_artifact(tracking_uri, tmp_path):
    _log_pipeline(tracking_uri, "old", shift=-0.1)
    latest = _log_pipeline(tracking_uri, "new")
    console = _console()
    runs, png = compare(tracking_uri, [], "grpo-compare-test", tmp_path / "c.png", console=console)
    assert [r.run_id for r in runs] == [latest]
    stages = runs[0].stages
    assert [s.stage for s in stages] == list(ACC)
    assert stages[1].rewards == pytest.approx([0.56, 0.66, 0.76])
    assert stages[0].rewards == [] and stages[0].wall_time_s == 40.0
    text = console.export_text()
    assert "76.0%" in text and "0.560->0.760" in text and "40s" in text
    assert png.read_bytes()[:4] == b"\x89PNG"

    from mlflow.tracking import MlflowClient

    arts = MlflowClient(tracking_uri).list_artifacts(latest, "compare")
    assert [a.path for a in arts] == ["compare/c.png"]


def test_compare_several_runs_by_name_and_id(tracking_uri, tmp_path):
    a = _log_pipeline(tracking_uri, "baseline")
    b = _log_pipeline(tracking_uri, "tuned", shift=0.02)
    console = _console()
    runs, _ = compare(tracking_uri, ["baseline", b], None, tmp_path / "c.png", False, console)
    assert [r.run_id for r in runs] == [a, b]
    text = console.export_text()
    assert "baseline" in text and "tuned" in text and "78.0%" in text


def test_compare_cli_reports_an_unknown_run(tracking_uri, tmp_path, capsys):
    _log_pipeline(tracking_uri, "only")
    argv = ["nope", "--tracking-uri", tracking_uri, "-o", str(tmp_path / "c.png")]
    assert main(argv) == 2
    assert "no pipeline run with id or name 'nope'" in capsys.readouterr().err


def test_register_final_checkpoint_is_a_plain_hf_directory(tracking_uri, tiny_checkpoint, tmp_path):
    parent = _log_pipeline(tracking_uri, "reg")
    metrics = {s: {"accuracy": a, "format_rate": 1.0, "mean_length": 29.0} for s, a in ACC.items()}
    v1 = register_final_checkpoint(tracking_uri, parent, tiny_checkpoint, metrics)
    v2 = register_final_checkpoint(tracking_uri, parent, tiny_checkpoint, metrics, "demo-model")
    assert (v1.name, str(v1.version), v2.name) == ("grpo-compare-test", "1", "demo-model")
    assert v1.tags["stage"] == "rl_2" and v1.tags["rl_1/eval/accuracy"] == "0.76"
    assert "| rl_2 | 95.0% | 100.0% | 29.0 |" in v1.description

    import mlflow
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    source = client.get_model_version_download_uri(v1.name, v1.version)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=source, dst_path=str(tmp_path), tracking_uri=tracking_uri
    )
    AutoTokenizer.from_pretrained(local)
    assert AutoModelForCausalLM.from_pretrained(local).config.hidden_size == 32

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        register_final_checkpoint(tracking_uri, parent, tmp_path / "empty", metrics)
