"""Rejection sampling reports completions that passed, duplicates, the per-prompt cap and the
ones kept apart: the stage's metrics, its MLflow run and table, its Prefect artifacts and the
one-line summary. A tiny real checkpoint samples, the real scorer writes the Parquet file,
MLflow is a sqlite store, Prefect the test harness's server."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpo_core.algorithm.rejection import (
    DUPLICATE,
    FAILED,
    KEPT,
    OVER_CAP,
    classify_completions,
    mix_sft_rows,
    select_completions,
)
from grpo_core.config.stages import RejectionConfig
from grpo_core.contracts.io import write_jsonl
from grpo_core.contracts.prompts import load_rows
from grpo_core.contracts.rollouts import read_scored
from grpo_core.demo.task import make_splits
from grpo_core.errors import UserError
from tasks.rejection import rejection_line, rejection_sampling
from tasks.tracking.stages import Tracking
from tasks.workspace import SamplingDir

COUNTS = ("sampled", "passed", "duplicates", "capped", "kept")


@pytest.fixture
def rl_data(tmp_path):
    s = make_splits(0, n_sft=8, n_rl=8, n_dev=2, n_eval=2)
    return str(write_jsonl(s.rl, tmp_path / "rl.jsonl"))


@pytest.fixture
def tracking(tracking_uri):
    return Tracking.open(tracking_uri, "rejection-report").start_parent("t", {})


def _run_in_flow(*args, **kwargs):
    """The task inside a real Prefect flow run (artifacts attach to it); the flow run id."""
    from prefect import flow
    from prefect.context import get_run_context

    @flow(name="rejection-report-test")
    def _f():
        return rejection_sampling(*args, **kwargs), str(get_run_context().flow_run.id)

    return _f()


def _artifacts(flow_run_id: str) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a.data for a in found if a.key}


def _mlflow_table(uri: str, run_id: str, name: str) -> list[dict]:
    import mlflow

    path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=name, tracking_uri=uri)
    with open(path) as f:
        t = json.load(f)
    return [dict(zip(t["columns"], row, strict=True)) for row in t["data"]]


def test_identical_passing_completions_read_as_passed_duplicates_and_one_kept(
    prefect_harness, tiny_checkpoint, rl_data, tmp_path, tracking
):
    # near-greedy sampling: each prompt's 4 completions are one text, and every one passes
    # (min_reward 0, nothing required); the cap (4) drops none
    cfg = RejectionConfig(
        num_prompts=4,
        num_generations=4,
        temperature=1e-4,
        max_completion_length=8,
        min_reward=0.0,
        max_per_prompt=4,
        require=[],
    )
    out, flow_run_id = _run_in_flow(
        str(tiny_checkpoint), rl_data, str(tmp_path / "rs"), cfg, {"format": 1.0}, tracking, 0
    )
    scored = read_scored(SamplingDir(tmp_path / "rs").scored).to_pylist()
    texts = defaultdict(set)
    for r in scored:
        texts[r["prompt_id"]].add(r["completion"].strip())
    assert len(texts) == 4 and all(len(t) == 1 for t in texts.values()), texts

    m = out.metrics
    assert {k: m[k] for k in COUNTS} == {
        "sampled": 16.0,
        "passed": 16.0,
        "duplicates": 12.0,
        "capped": 0.0,
        "kept": 4.0,
    }
    assert m["pass_rate"] == 1.0 and m["acceptance_rate"] == 0.25
    assert all(isinstance(v, float) for v in m.values())
    line = rejection_line(m)
    assert line == "rejection sampling: 16 sampled, 16 passed (100.0%), 12 duplicates, 4 kept"
    assert len(Path(out.path).read_text().splitlines()) == 4

    # the MLflow run: the counts as metrics, and per prompt 4 passed, 3 duplicates, 1 kept
    run = MlflowClient(tracking.uri).get_run(out.run_id)
    assert {k: run.data.metrics[k] for k in (*COUNTS, "pass_rate")} == {
        **{k: m[k] for k in COUNTS},
        "pass_rate": 1.0,
    }
    table = _mlflow_table(tracking.uri, out.run_id, "acceptance_by_prompt.json")
    assert len(table) == 4
    for row in table:
        assert {k: row[k] for k in COUNTS} == {
            "sampled": 4,
            "passed": 4,
            "duplicates": 3,
            "capped": 0,
            "kept": 1,
        }
        assert row["pass_rate"] == 1.0 and row["acceptance_rate"] == 0.25
        assert row["mean_reward"] == round(row["mean_reward"], 3)

    # the Prefect artifacts: the summary names passed / duplicates / kept, the table per prompt
    arts = _artifacts(flow_run_id)
    md = arts["rejection-sampling"]
    assert line in md
    assert "**16** of **16** sampled completions passed (100.0%)" in md
    assert "12 of the passing ones were duplicates" in md
    assert "0 passing, distinct ones were over the per-prompt cap (max_per_prompt 4" in md
    assert "Kept **4** of **16** completions (25.0%)" in md
    by_prompt = json.loads(arts["rejection-sampling-by-prompt"])
    assert len(by_prompt) == 4
    assert all(
        (r["sampled"], r["passed"], r["duplicates"], r["kept"], r["pass_rate"]) == (4, 4, 3, 1, 1.0)
        for r in by_prompt
    )
    assert "prompt_id" not in by_prompt[0]


def test_the_per_prompt_cap_is_named_and_a_cached_rerun_reports_the_same(
    tiny_checkpoint, rl_data, tmp_path, tracking
):
    # distinct samples (temperature 1), at most one kept per prompt: the rest is capped
    cfg = RejectionConfig(
        num_prompts=4,
        num_generations=4,
        max_completion_length=8,
        min_reward=0.0,
        max_per_prompt=1,
        require=[],
    )
    args = (str(tiny_checkpoint), rl_data, str(tmp_path / "rs"), cfg, {"format": 1.0}, tracking, 0)
    out = rejection_sampling.fn(*args)
    m = out.metrics
    assert m["passed"] == m["sampled"] == 16 and m["kept"] == 4
    assert m["capped"] > 0 and m["passed"] == m["duplicates"] + m["capped"] + m["kept"]
    assert f"{int(m['capped'])} over the per-prompt cap, 4 kept" in rejection_line(m)

    again = rejection_sampling.fn(*args)
    assert again.cached and {k: again.metrics[k] for k in m} == m
    run = MlflowClient(tracking.uri).get_run(again.run_id)
    assert run.data.metrics["passed"] == 16 and run.data.metrics["capped"] == m["capped"]


def test_mixed_cold_start_rows_join_the_kept_ones_and_key_the_stage(
    tiny_checkpoint, rl_data, tmp_path, tracking
):
    sft = make_splits(1, n_sft=8, n_rl=8, n_dev=2, n_eval=2).sft
    sft_data = str(write_jsonl(sft, tmp_path / "sft.jsonl"))
    plain = RejectionConfig(num_prompts=4, num_generations=2, max_completion_length=8,
                            min_reward=0.0, max_per_prompt=2, require=[])  # fmt: skip
    mixing = plain.model_copy(update={"mix_sft_rows": 3})
    base = (str(tiny_checkpoint), rl_data)
    rest = ({"format": 1.0}, tracking, 0)

    alone = rejection_sampling.fn(
        *base, str(tmp_path / "a"), plain, *rest, cold_start_data=sft_data
    )
    mixed = rejection_sampling.fn(
        *base, str(tmp_path / "m"), mixing, *rest, cold_start_data=sft_data
    )
    kept = int(mixed.metrics["kept"])
    assert kept == alone.metrics["kept"] and "mixed_sft_rows" not in alone.metrics
    assert mixed.metrics["mixed_sft_rows"] == 3.0
    rows = load_rows(mixed.path, required=("prompt", "completion"))
    assert rows[:kept] == load_rows(alone.path, required=("prompt", "completion"))
    assert rows[kept:] == mix_sft_rows(sft, 3, 0) and all(r in sft for r in rows[kept:])
    assert rejection_line(mixed.metrics).endswith(f"{kept} kept, + 3 cold-start SFT rows")

    # the SFT file is an input of the mixing stage's key (only): a changed file reruns it
    run = MlflowClient(tracking.uri).get_run
    assert run(mixed.run_id).data.tags["cache_key"] != run(alone.run_id).data.tags["cache_key"]
    write_jsonl(sft[::-1], tmp_path / "sft.jsonl")
    again = rejection_sampling.fn(
        *base, str(tmp_path / "m"), mixing, *rest, cold_start_data=sft_data
    )
    assert not again.cached
    assert rejection_sampling.fn(*base, str(tmp_path / "a"), plain, *rest).cached

    with pytest.raises(UserError, match="mix_sft_rows: no cold-start SFT data"):
        rejection_sampling.fn(*base, str(tmp_path / "x"), mixing, *rest)


def _row(prompt_id: str, completion: str, reward: float | None, **rewards) -> dict:
    return {
        "prompt_id": prompt_id,
        "completion": completion,
        "reward": reward,
        **{f"reward_{k}": v for k, v in rewards.items()},
    }


def test_classification_is_what_select_completions_keeps():
    rows = [
        _row("a", "x", 1.0, accuracy=1.0),
        _row("a", " x \n", 1.0, accuracy=1.0),  # the same text: a duplicate
        _row("a", "y", 1.0, accuracy=0.0),  # short of a required reward: failed
        _row("a", "z", 0.1, accuracy=1.0),  # below min_reward: failed
        _row("a", "w", None),  # not scored: failed
        _row("a", "v", 1.0, accuracy=1.0),  # passed, distinct: kept (cap 2)
        _row("a", "u", 1.0, accuracy=1.0),  # passed, distinct, a third one: over the cap
        _row("a", "u", 1.0, accuracy=1.0),  # a repeat of the capped one: a duplicate
        _row("b", "x", 1.0, accuracy=1.0),  # the same text for another prompt: kept
    ]
    kw = dict(min_reward=0.5, max_per_prompt=2, require={"accuracy": 1.0})
    status = classify_completions(rows, **kw)
    assert status == [
        KEPT,
        DUPLICATE,
        FAILED,
        FAILED,
        FAILED,
        KEPT,
        OVER_CAP,
        DUPLICATE,
        KEPT,
    ]
    assert select_completions(rows, **kw) == [rows[0], rows[5], rows[8]]


def test_rejection_line_of_an_older_summary_without_passed():
    assert (
        rejection_line({"sampled": 2048.0, "kept": 484.0, "acceptance_rate": 0.236328125})
        == "rejection sampling: 2048 sampled, 484 kept (23.6%)"
    )
    summary = {"sampled": 2048.0, "passed": 1530.0, "duplicates": 1046.0, "kept": 484.0}
    assert (
        rejection_line(summary)
        == "rejection sampling: 2048 sampled, 1530 passed (74.7%), 1046 duplicates, 484 kept"
    )
    capped = {**summary, "duplicates": 1000.0}  # no `capped`: passed - duplicates - kept
    assert "1000 duplicates, 46 over the per-prompt cap, 484 kept" in rejection_line(capped)
