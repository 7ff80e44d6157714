"""The model registry's ``champion`` alias follows the best held-out accuracy, not the last
run: a real MLflow sqlite store, a tiny real checkpoint registered once per pipeline run."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from flows.model_registry import (
    ACCURACY_TAG,
    CHAMPION,
    register_final_checkpoint,
    registration_line,
)
from tasks.tracking.stages import Tracking

MODEL = "champion-test"


def _pipeline_run(uri: str, name: str) -> str:
    t = Tracking.open(uri, MODEL).start_parent(name, {"pipeline": "r1"})
    t.end(t.parent_run_id)
    return t.parent_run_id


def _metrics(accuracy: float) -> dict:
    return {
        "cold_start_sft": {"accuracy": 0.1, "format_rate": 1.0, "mean_length": 20.0},
        "rl_2": {"accuracy": accuracy, "format_rate": 0.9, "mean_length": 29.0},
    }


def _register(uri: str, ckpt, run_name: str, accuracy: float):
    return register_final_checkpoint(
        uri, _pipeline_run(uri, run_name), ckpt, _metrics(accuracy), final_stage="rl_2"
    )


def _champion(client: MlflowClient) -> str:
    return str(client.get_model_version_by_alias(MODEL, CHAMPION).version)


def test_champion_alias_moves_to_the_best_accuracy_and_stays(
    tracking_uri, tiny_checkpoint, tmp_path
):
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)

    v1 = _register(tracking_uri, tiny_checkpoint, "first", 0.3)
    assert (v1.name, str(v1.version)) == (MODEL, "1")  # read through to the ModelVersion
    assert (v1.champion_version, v1.champion_accuracy, v1.is_champion) == ("1", 0.3, True)
    assert _champion(client) == "1"

    v2 = _register(tracking_uri, tiny_checkpoint, "second", 0.5)
    assert (v2.champion_version, v2.champion_accuracy, v2.is_champion) == ("2", 0.5, True)
    assert _champion(client) == "2"

    v3 = _register(tracking_uri, tiny_checkpoint, "third", 0.4)
    assert (str(v3.version), v3.champion_version, v3.champion_accuracy) == ("3", "2", 0.5)
    assert not v3.is_champion and _champion(client) == "2"
    assert v3.line() == f"registered as {MODEL}/3 (champion: version 2, accuracy 50.0%)"
    assert v3.champion() == {
        "version": "2",
        "accuracy": 0.5,
        "uri": f"models:/{MODEL}@{CHAMPION}",
        "is_new_version": False,
    }
    assert v2.line() == f"registered as {MODEL}/2 (champion: this version, accuracy 50.0%)"

    v4 = _register(tracking_uri, tiny_checkpoint, "tie", 0.5)  # a tie keeps the older one
    assert v4.champion_version == "2" and _champion(client) == "2"
    aliases = client.get_registered_model(MODEL).aliases
    assert {k: str(v) for k, v in aliases.items()} == {CHAMPION: "2"}

    # the tags and description of each version, as stored
    for v, run_name, acc in ((v1, "first", 0.3), (v2, "second", 0.5), (v3, "third", 0.4)):
        stored = client.get_model_version(MODEL, v.version)
        assert stored.tags[ACCURACY_TAG] == f"{acc:g}"
        assert stored.tags["stage"] == "rl_2" and stored.tags["run_name"] == run_name
        assert stored.tags["rl_2/eval/accuracy"] == f"{acc:g}"
        assert f"Held-out accuracy (rl_2): **{100 * acc:.1f}%**." in stored.description
        assert v.tags == stored.tags
    assert f"models:/{MODEL}@{CHAMPION}" in client.get_registered_model(MODEL).description

    import mlflow

    # the alias is a model URI: it downloads the champion's Hugging Face directory
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/{MODEL}@{CHAMPION}",
        dst_path=str(tmp_path),
        tracking_uri=tracking_uri,
    )
    assert {"config.json", "model.safetensors"} <= {p.name for p in Path(local).iterdir()}


def test_without_the_alias_the_best_tagged_version_is_the_champion(tracking_uri, tiny_checkpoint):
    """Versions registered before the alias existed (or after someone deleted it): the best
    of their accuracy tags (``<stage>/eval/accuracy`` where ``heldout_accuracy`` is missing)."""
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    for name, acc in (("a", 0.6), ("b", 0.2)):
        _register(tracking_uri, tiny_checkpoint, name, acc)
    client.delete_registered_model_alias(MODEL, CHAMPION)
    client.delete_model_version_tag(MODEL, "1", ACCURACY_TAG)  # as registered before the tag

    v3 = _register(tracking_uri, tiny_checkpoint, "c", 0.4)
    assert (v3.champion_version, v3.champion_accuracy) == ("1", 0.6)
    assert _champion(client) == "1"

    # a run without a held-out accuracy never becomes the champion
    none = register_final_checkpoint(
        tracking_uri, _pipeline_run(tracking_uri, "d"), tiny_checkpoint, {}, final_stage="rl_2"
    )
    assert ACCURACY_TAG not in none.tags and none.accuracy is None
    assert none.champion_version == "1" and _champion(client) == "1"


def test_registration_line_of_a_summary():
    champion = {"version": "2", "accuracy": 0.41, "is_new_version": False}
    assert (
        registration_line("grpo-demo/3", champion)
        == "registered as grpo-demo/3 (champion: version 2, accuracy 41.0%)"
    )
    assert registration_line("grpo-demo/1", None) == (
        "registered as grpo-demo/1 (no champion: no held-out accuracy)"
    )
