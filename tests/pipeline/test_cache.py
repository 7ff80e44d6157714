"""Stage caching (tasks/cache.py): a stage's key is its config + the content of its inputs +
the code version; the same key with its outputs on disk returns the recorded result without
running the stage; a changed input, config or code version, a missing output or ``force``
runs it again."""

import dataclasses
import json
import os
import shutil

import pytest

from grpo_core.config.stages import EvalConfig, RLConfig, SFTConfig
from grpo_core.contracts.io import write_jsonl
from grpo_core.demo.task import make_splits
from tasks import cache
from tasks import score as score_module
from tasks.evaluate import evaluate_checkpoint
from tasks.results import EvalOutcome, SFTOutcome
from tasks.rollout import rollout
from tasks.score import score
from tasks.sft import sft_stage
from tasks.tracking.stages import Tracking


class Stage:
    """A stage body that writes its output (and any ``extra`` outputs) and counts how often
    it ran."""

    def __init__(self, output, *extra):
        self.output = output
        self.extra = extra
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        for path in (self.output, *self.extra):
            path.write_text(f"run {self.calls}")
        return {"path": str(self.output), "value": float(self.calls)}


@pytest.fixture
def inputs(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    return data


def test_unchanged_key_reuses_the_record_without_running_the_stage(inputs, tmp_path):
    stage = Stage(tmp_path / "out.parquet")
    key = cache.stage_key("score", {"rewards": {"format": 1.0}}, [inputs])
    first = cache.cached("score", stage.output, key, stage)
    again = cache.cached("score", stage.output, key, stage)
    assert stage.calls == 1
    assert first == {"path": str(stage.output), "value": 1.0, "cached": False}
    assert again == {**first, "cached": True}
    assert stage.output.read_text() == "run 1"  # not rewritten
    manifest = json.loads(cache.manifest_path(stage.output).read_text())
    assert manifest["key"] == key and manifest["code_version"] == cache.code_version()
    # the key is recomputed from scratch each time: same config and same bytes, same key
    assert cache.stage_key("score", {"rewards": {"format": 1.0}}, [inputs]) == key


def test_changed_input_file_changes_the_key_and_reruns(inputs, tmp_path):
    stage = Stage(tmp_path / "out.parquet")
    key = cache.stage_key("score", {}, [inputs])
    cache.cached("score", stage.output, key, stage)
    inputs.write_text('{"prompt": "1+2", "answer": "3"}\n')
    changed = cache.stage_key("score", {}, [inputs])
    assert changed != key
    assert cache.cached("score", stage.output, changed, stage)["cached"] is False
    assert stage.calls == 2
    assert cache.cached("score", stage.output, changed, stage)["cached"] is True
    assert stage.calls == 2


def test_the_key_is_the_content_not_the_path(inputs, tmp_path):
    copy = tmp_path / "elsewhere" / "renamed.jsonl"
    copy.parent.mkdir()
    shutil.copy(inputs, copy)
    os.utime(copy, ns=(1, 1))  # another mtime too: only the bytes count
    assert cache.stage_key("rollout", {"a": 1}, [copy]) == cache.stage_key(
        "rollout", {"a": 1}, [inputs]
    )
    assert cache.stage_key("rollout", {"a": 1}, [inputs]) != cache.stage_key(
        "update", {"a": 1}, [inputs]
    )


def test_changed_config_changes_the_key_and_reruns(inputs, tmp_path):
    stage = Stage(tmp_path / "out.parquet")
    weights = {"accuracy": 1.0, "format": 0.1}
    cache.cached("score", stage.output, cache.stage_key("score", weights, [inputs]), stage)
    reweighted = cache.stage_key("score", {**weights, "format": 0.2}, [inputs])
    assert cache.cached("score", stage.output, reweighted, stage)["cached"] is False
    assert stage.calls == 2


def test_changed_code_version_changes_the_key_and_reruns(inputs, tmp_path, monkeypatch):
    stage = Stage(tmp_path / "out.parquet")
    key = cache.stage_key("score", {}, [inputs])
    cache.cached("score", stage.output, key, stage)
    monkeypatch.setattr(cache, "code_version", lambda: "another-version")
    new_code = cache.stage_key("score", {}, [inputs])
    assert new_code != key
    assert cache.cached("score", stage.output, new_code, stage)["cached"] is False
    assert stage.calls == 2


def test_code_version_hashes_the_grpo_core_and_tasks_sources(tmp_path, monkeypatch):
    """A fake source tree: editing or adding a module of grpo_core/ or tasks/ changes the
    version; editing flows/ (wiring only, every input passed explicitly) does not."""
    for rel in ("grpo_core/algorithm/losses.py", "tasks/cache.py", "flows/r1.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    monkeypatch.setattr(cache, "__file__", str(tmp_path / "tasks" / "cache.py"))
    version = cache.code_version.__wrapped__  # the computation, without the process memo

    v0 = version()
    assert version() == v0
    (tmp_path / "flows" / "r1.py").write_text("# the CLI changed\n")
    assert version() == v0
    (tmp_path / "grpo_core" / "algorithm" / "losses.py").write_text("# the loss changed\n")
    v1 = version()
    assert v1 != v0
    (tmp_path / "tasks" / "score.py").write_text("# a new task module\n")
    assert version() not in (v0, v1)


def test_missing_output_broken_manifest_or_force_reruns(inputs, tmp_path):
    extra = tmp_path / "out.extra"
    stage = Stage(tmp_path / "out.parquet", extra)
    key = cache.stage_key("update", {}, [inputs])
    cache.cached("update", stage.output, key, stage, outputs=[extra])
    assert cache.cached("update", stage.output, key, stage, force=True)["cached"] is False
    assert stage.calls == 2
    stage.output.unlink()
    assert cache.cached("update", stage.output, key, stage, outputs=[extra])["cached"] is False
    assert stage.calls == 3
    extra.unlink()  # another output of the stage is gone
    assert cache.cached("update", stage.output, key, stage, outputs=[extra])["cached"] is False
    assert stage.calls == 4
    cache.manifest_path(stage.output).write_text("{not json")
    assert cache.cached("update", stage.output, key, stage)["cached"] is False
    assert stage.calls == 5
    assert cache.cached("update", stage.output, key, stage)["cached"] is True
    assert stage.calls == 5


# The same rules through the real stage tasks.


@pytest.fixture
def rl_path(tmp_path):
    return str(
        write_jsonl(make_splits(0, n_sft=8, n_rl=16, n_dev=1, n_eval=1).rl, tmp_path / "rl.jsonl")
    )


def _rl(**overrides) -> RLConfig:
    return RLConfig(
        prompts_per_iteration=2,
        num_generations=2,
        steps_per_generation=1,
        max_completion_length=6,
        **overrides,
    )


def test_rollout_and_score_tasks_are_reused_until_an_input_changes(
    tiny_checkpoint, rl_path, tmp_path, monkeypatch
):
    rl = _rl()
    r_path = str(tmp_path / "r.parquet")
    first = rollout.fn("rl_1", 0, str(tiny_checkpoint), rl_path, r_path, rl, 0)
    mtime = os.stat(r_path).st_mtime_ns
    again = rollout.fn("rl_1", 0, str(tiny_checkpoint), rl_path, r_path, rl, 0)
    assert not first.cached and again.cached
    assert os.stat(r_path).st_mtime_ns == mtime  # not rewritten
    assert again.metrics == first.metrics
    # another iteration or sampling setting is another key
    assert not rollout.fn("rl_1", 1, str(tiny_checkpoint), rl_path, r_path, rl, 0).cached
    assert rollout.fn("rl_1", 1, str(tiny_checkpoint), rl_path, r_path, rl, 0).cached
    hotter = _rl(temperature=0.5)
    assert not rollout.fn("rl_1", 1, str(tiny_checkpoint), rl_path, r_path, hotter, 0).cached
    forced = rollout.fn("rl_1", 1, str(tiny_checkpoint), rl_path, r_path, hotter, 0, force=True)
    assert not forced.cached

    calls = []
    real = score_module.score_file
    monkeypatch.setattr(
        score_module, "score_file", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    s_path = str(tmp_path / "s.parquet")
    a = score.fn("rl_1", 0, r_path, s_path, {"format": 1.0}, rl)
    b = score.fn("rl_1", 0, r_path, s_path, {"format": 1.0}, rl)
    assert (a.cached, b.cached, len(calls)) == (False, True, 1)
    c = score.fn("rl_1", 0, r_path, s_path, {"format": 0.5, "tag_count": 1.0}, rl)
    assert (c.cached, len(calls)) == (False, 2)
    # a new rollout file under the same name is a changed input: scored again
    rollout.fn("rl_1", 2, str(tiny_checkpoint), rl_path, r_path, rl, 0)
    d = score.fn("rl_1", 0, r_path, s_path, {"format": 0.5, "tag_count": 1.0}, rl)
    assert (d.cached, len(calls)) == (False, 3)


def test_deleted_rollout_file_is_recomputed(tiny_checkpoint, rl_path, tmp_path):
    rl = _rl()
    r_path = tmp_path / "r.parquet"
    rollout.fn("rl_1", 0, str(tiny_checkpoint), rl_path, str(r_path), rl, 0)
    r_path.unlink()
    out = rollout.fn("rl_1", 0, str(tiny_checkpoint), rl_path, str(r_path), rl, 0)
    assert not out.cached and r_path.exists()


def test_sft_stage_cache_records_a_cached_child_run(tiny_checkpoint, tmp_path, tracking_uri):
    from mlflow.tracking import MlflowClient

    data = str(
        write_jsonl(make_splits(0, n_sft=16, n_rl=1, n_dev=1, n_eval=1).sft, tmp_path / "sft.jsonl")
    )
    tracking = Tracking.open(tracking_uri, "cache").start_parent("p", {})
    cfg = SFTConfig(max_steps=5, batch_size=4)
    out_dir = str(tmp_path / "sft")
    first = sft_stage.fn("cold_start_sft", str(tiny_checkpoint), data, out_dir, cfg, tracking)
    second = sft_stage.fn("cold_start_sft", str(tiny_checkpoint), data, out_dir, cfg, tracking)
    assert isinstance(second, SFTOutcome)
    assert (first.cached, second.cached) == (False, True)
    assert dataclasses.replace(second, run_id=None, cached=False) == dataclasses.replace(
        first, run_id=None
    )
    assert second.run_id != first.run_id  # each call has its own child run
    record = json.loads(cache.manifest_path(out_dir).read_text())["result"]
    assert record["type"] == "SFTOutcome" and not {"run_id", "cached"} & set(record)
    run = MlflowClient(tracking_uri).get_run(second.run_id)
    assert run.data.tags["cached"] == "true" and run.data.metrics["steps"] == 5
    assert "cached" not in run.data.metrics
    changed = sft_stage.fn(
        "cold_start_sft",
        str(tiny_checkpoint),
        data,
        out_dir,
        SFTConfig(max_steps=6, batch_size=4),
        tracking,
    )
    assert not changed.cached and changed.steps == 6


def test_eval_task_is_reused_as_the_same_typed_result(tiny_checkpoint, tmp_path):
    data = str(
        write_jsonl(make_splits(0, n_sft=1, n_rl=1, n_dev=1, n_eval=4).eval, tmp_path / "e.jsonl")
    )
    cfg = EvalConfig(max_completion_length=6)
    table = str(tmp_path / "eval.parquet")
    first = evaluate_checkpoint(str(tiny_checkpoint), data, cfg, out_table=table)
    mtime = os.stat(table).st_mtime_ns
    again = evaluate_checkpoint(str(tiny_checkpoint), data, cfg, out_table=table)
    assert isinstance(again, EvalOutcome) and (first.cached, again.cached) == (False, True)
    assert dataclasses.replace(again, cached=False) == first
    assert os.stat(table).st_mtime_ns == mtime  # not rewritten
    unrecorded = evaluate_checkpoint(str(tiny_checkpoint), data, cfg)  # no table: no cache
    assert unrecorded.table is None and not unrecorded.cached


def test_final_eval_copies_the_in_loop_eval_of_the_same_weights(tiny_checkpoint, tmp_path, caplog):
    """An RL stage's final checkpoint links its last iteration's files: the final evaluation
    copies that iteration's eval table instead of evaluating again; other weights or settings
    are evaluated."""
    import pyarrow.parquet as pq

    from grpo_core.contracts.io import link_tree

    data = str(
        write_jsonl(make_splits(0, n_sft=1, n_rl=1, n_dev=1, n_eval=4).eval, tmp_path / "e.jsonl")
    )
    cfg = EvalConfig(max_completion_length=6)
    in_loop = str(tmp_path / "iter_0004_eval.parquet")
    first = evaluate_checkpoint(str(tiny_checkpoint), data, cfg, out_table=in_loop)
    final_ckpt = link_tree(tiny_checkpoint, tmp_path / "final")  # as flows/rl.py makes it
    table = str(tmp_path / "final_eval.parquet")
    with caplog.at_level("INFO"):
        final = evaluate_checkpoint(str(final_ckpt), data, cfg, out_table=table, same_as=in_loop)
    assert "reused" in caplog.text
    assert final.table == table and final.accuracy == first.accuracy
    assert dataclasses.replace(final, table=in_loop) == first
    assert pq.read_table(table).equals(pq.read_table(in_loop))
    again = evaluate_checkpoint(str(final_ckpt), data, cfg, out_table=table, same_as=in_loop)
    assert again.cached  # its own manifest now
    other = cfg.model_copy(update={"max_completion_length": 5})
    caplog.clear()
    with caplog.at_level("INFO"):
        fresh = evaluate_checkpoint(
            str(final_ckpt), data, other, out_table=str(tmp_path / "o.parquet"), same_as=in_loop
        )
    assert "reused" not in caplog.text and not fresh.cached
