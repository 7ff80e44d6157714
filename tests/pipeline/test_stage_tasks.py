"""Each stage task on its own (``task.fn``: the body without the engine), with real files,
a real tiny model and a real MLflow sqlite store."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from grpo_core import rewards
from grpo_core.config.stages import EvalConfig, RejectionConfig, RLConfig, SFTConfig
from grpo_core.contracts.io import write_jsonl, write_parquet
from grpo_core.contracts.prompts import load_rows
from grpo_core.contracts.text import encode_prompt, prompt_text
from grpo_core.demo.task import make_splits
from grpo_core.errors import UserError
from grpo_core.rewards.format import is_r1_format
from grpo_core.training.checkpoint import load_checkpoint, policy_id, save_checkpoint
from grpo_core.training.sft import train_sft
from tasks.evaluate import evaluate_stage
from tasks.policies.trainer import open_trainer
from tasks.rejection import rejection_sampling
from tasks.results import EvalOutcome, RejectionOutcome, SFTOutcome
from tasks.rollout import rollout
from tasks.score import score
from tasks.sft import sft_stage
from tasks.tracking.stages import Tracking
from tasks.update import UpdateRequest, update


@pytest.fixture
def data(tmp_path):
    s = make_splits(0, n_sft=32, n_rl=32, n_dev=4, n_eval=8)
    return {
        k: str(write_jsonl(getattr(s, k), tmp_path / f"{k}.jsonl"))
        for k in ("sft", "rl", "dev", "eval")
    }


@pytest.fixture
def tracking(tracking_uri):
    return Tracking.open(tracking_uri, "tests").start_parent("t", {})


def test_sft_task_writes_checkpoint_and_child_run(tiny_checkpoint, data, tmp_path, tracking):
    out = sft_stage.fn(
        "cold_start_sft",
        str(tiny_checkpoint),
        data["sft"],
        str(tmp_path / "sft"),
        SFTConfig(max_steps=12, batch_size=8, eval_every=5),
        tracking,
    )
    assert isinstance(out, SFTOutcome) and out.steps == 12 and not out.cached
    assert policy_id(out.checkpoint) != policy_id(tiny_checkpoint)
    assert out.policy_id == policy_id(out.checkpoint) and out.train_examples == 32
    run = MlflowClient(tracking.uri).get_run(out.run_id)
    assert run.data.tags["stage"] == "cold_start_sft"
    assert run.data.tags["mlflow.parentRunId"] == tracking.parent_run_id
    assert run.data.params["learning_rate"] == "0.003"
    assert "loss" in run.data.metrics
    assert run.data.metrics["stopped_early"] == 0.0 and run.data.metrics["steps"] == 12
    assert "cached" not in run.data.metrics and run.data.tags["cached"] == "false"


def test_rl_iteration_tasks_chain_through_files(tiny_checkpoint, data, tmp_path):
    rl = RLConfig(
        prompts_per_iteration=4, num_generations=4, steps_per_generation=2, max_completion_length=12
    )
    open_trainer().forget()
    loads = open_trainer().stats["loads"]
    roll = rollout.fn(
        "rl_1", 0, str(tiny_checkpoint), data["rl"], str(tmp_path / "r.parquet"), rl, 0
    )
    sc = score.fn(
        "rl_1",
        0,
        roll.path,
        str(tmp_path / "s.parquet"),
        {"accuracy": 1.0, "format": 0.1},
        rl,
    )
    up = update.fn(
        UpdateRequest(str(tiny_checkpoint), sc.path, str(tmp_path / "ckpt"), rl, stage="rl_1"), 0
    )
    assert pq.read_table(roll.path).num_rows == 16
    assert len(up.history) == 2 and up.global_step == 2
    assert (
        open_trainer().stats["loads"] == loads + 1
    )  # loaded once, then warm from rollout to update
    # the next rollout asks for the new checkpoint: still no load from disk
    rollout.fn("rl_1", 1, up.checkpoint, data["rl"], str(tmp_path / "r1.parquet"), rl, 0)
    assert open_trainer().stats["loads"] == loads + 1
    state = json.loads((tmp_path / "ckpt" / "checkpoint_info.json").read_text())
    assert state["global_step"] == 2


def test_update_from_a_scored_file_of_another_run_loads_from_disk(tiny_checkpoint, data, tmp_path):
    rl = RLConfig(
        prompts_per_iteration=2, num_generations=2, steps_per_generation=1, max_completion_length=8
    )
    roll = rollout.fn(
        "rl_1", 0, str(tiny_checkpoint), data["rl"], str(tmp_path / "r.parquet"), rl, 0
    )
    sc = score.fn("rl_1", 0, roll.path, str(tmp_path / "s.parquet"), {"format": 1.0}, rl)
    open_trainer().forget()
    loads = open_trainer().stats["loads"]
    up = update.fn(UpdateRequest(str(tiny_checkpoint), sc.path, str(tmp_path / "ckpt"), rl), 0)
    assert open_trainer().stats["loads"] == loads + 1
    assert (tmp_path / "ckpt" / "trainer_state.pt").exists()
    assert up.history[0]["learning_rate"] == pytest.approx(rl.learning_rate)


@pytest.fixture(scope="module")
def sft_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny model after 10 SFT steps: its greedy completions are text that differs from
    prompt to prompt (the random model's greedy output is special tokens only)."""
    model, tok = load_checkpoint(tiny_checkpoint)
    rows = make_splits(0, n_sft=64, n_rl=1, n_dev=1, n_eval=1).sft
    train_sft(model, tok, rows, max_steps=10, batch_size=16, learning_rate=3e-3, seed=0)
    return save_checkpoint(model, tok, tmp_path_factory.mktemp("sft") / "ckpt")


@rewards.register("test_length_parity", replace=True)
def _length_parity(prompts, completions, answer, **_):
    """A reward that reads the completion and the row's answer: 1.0 when the number of
    characters of the completion and the gold answer have the same parity."""
    return [
        float(len(rewards.completion_text(c)) % 2 == int(a) % 2)
        for c, a in zip(completions, answer, strict=True)
    ]


def _greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Greedy decoding the slow obvious way: one unpadded full forward per token."""
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
            ids.append(token)
    return out


def test_eval_task_table_is_the_greedy_completions_scored_row_by_row(
    sft_checkpoint, data, tmp_path
):
    n_new = 24
    cfg = EvalConfig(max_completion_length=n_new, accuracy_reward="test_length_parity")
    out = evaluate_stage.fn("rl_1", str(sft_checkpoint), data["eval"], cfg, str(tmp_path / "e.pq"))
    table = pq.read_table(tmp_path / "e.pq").to_pylist()
    rows = load_rows(data["eval"])
    assert isinstance(out, EvalOutcome) and out.table == str(tmp_path / "e.pq")
    assert len(table) == len(rows) == out.num_examples == 8

    model, tok = load_checkpoint(sft_checkpoint)
    for t, r in zip(table, rows, strict=True):
        ids = _greedy(model, encode_prompt(tok, r["prompt"]), n_new, tok.eos_token_id)
        assert t["prompt"] == prompt_text(tok, r["prompt"]) and t["answer"] == r["answer"]
        assert t["completion"] == tok.decode(ids, skip_special_tokens=True)
        assert t["length"] == len(ids)
        assert t["finish_reason"] == ("stop" if ids[-1] == tok.eos_token_id else "length")
        assert t["correct"] == float(len(t["completion"]) % 2 == int(r["answer"]) % 2)
        assert t["formatted"] == float(is_r1_format(t["completion"]))
    assert len({t["completion"] for t in table}) > 1  # rows a misalignment would mix up
    n = len(table)
    assert out.accuracy == pytest.approx(sum(t["correct"] for t in table) / n)
    assert out.format_rate == pytest.approx(sum(t["formatted"] for t in table) / n)
    assert out.mean_length == pytest.approx(sum(t["length"] for t in table) / n)
    assert out.samples == table[: cfg.sample_table_rows]


def test_rejection_sampling_keeps_only_passing_completions(
    tiny_checkpoint, data, tmp_path, tracking
):
    cfg = RejectionConfig(
        num_prompts=8, num_generations=4, max_completion_length=8, require=[], min_reward=0.0
    )
    out = rejection_sampling.fn(
        str(tiny_checkpoint), data["rl"], str(tmp_path / "rs"), cfg, {"format": 1.0}, tracking, 0
    )
    assert isinstance(out, RejectionOutcome) and not out.cached
    rows = [json.loads(line) for line in Path(out.path).read_text().splitlines()]
    assert out.metrics["kept"] == len(rows) and out.metrics["sampled"] == 8 * 4
    assert all(isinstance(v, float) for v in out.metrics.values())
    run = MlflowClient(tracking.uri).get_run(out.run_id)
    assert run.data.metrics["kept"] == len(rows) and "cached" not in run.data.metrics
    assert 0 < len(rows) <= 8 * 2  # max_per_prompt = 2
    assert all(set(r) >= {"prompt", "completion", "answer"} for r in rows)
    assert not any(k.startswith(("reward", "error_")) for r in rows for k in r)
    strict = RejectionConfig(
        num_prompts=8, num_generations=2, max_completion_length=8, require=["accuracy"]
    )
    with pytest.raises(UserError, match="kept no completion.*rejection_sampling.require"):
        rejection_sampling.fn(
            str(tiny_checkpoint),
            data["rl"],
            str(tmp_path / "rs2"),
            strict,
            {"accuracy": 1.0},
            tracking,
            0,
        )


def _designed_rollout(path: str, out: str) -> str:
    """The rollout file with its completion texts replaced so that the rewards are known.

    Reward functions score the ``completion`` text; the update trains on the token ids and
    sampling log-probs, which stay as the engine wrote them. With rewards ``accuracy`` (1.0)
    and ``format`` (0.1): every completion of the first group is correct and well formatted
    (reward 1.1 each, a group without variance), and in every other group even samples are
    (1.1) and odd ones are not (0.0).
    """
    table = pq.read_table(path)
    rows = table.to_pylist()
    first = rows[0]["prompt_id"]
    right = "<think>x</think><answer>{}</answer>"
    texts = [
        right.format(r["answer"])
        if r["prompt_id"] == first or r["sample_idx"] % 2 == 0
        else "<answer>no</answer>"
        for r in rows
    ]
    i = table.column_names.index("completion")
    write_parquet(table.set_column(i, "completion", pa.array(texts, pa.string())), out)
    return out


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "grpo", "beta": 0.04, "kl_estimator": "k1"},
        {"loss_type": "dr_grpo", "advantage_estimator": "dr_grpo", "scale_rewards": "none"},
        {"advantage_estimator": "rloo", "scale_rewards": "none", "epsilon_high": 0.28},
        {"importance_sampling_level": "sequence", "num_iterations": 2},
        {"objective": "cispo", "epsilon_high": 4.0},
        {"clip_ratio_c": 3.0, "delta": 1.5, "top_entropy_quantile": 0.2},
        {"dynamic_sampling": True, "mask_truncated_completions": True},
        {"multi_objective_aggregation": "normalize_then_sum", "overlong_buffer_length": 4},
        {
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_truncate",
        },
        {"bf16": True},  # the correction's default (auto) turns it on: autocast differs
    ],
    ids=lambda o: ",".join(o),
)
def test_every_rl_option_runs_through_score_and_update(tiny_checkpoint, data, tmp_path, options):
    # 8 generations: the group of eight equal rewards 1.1 is the one whose running-moment std
    # is ~1e-16 instead of 0 (four equal values give an exact 0)
    rl = RLConfig(
        prompts_per_iteration=4,
        num_generations=8,
        steps_per_generation=2,
        max_completion_length=12,
        temperature=0.7,
        **options,
    )
    roll = rollout.fn(
        "rl_1", 0, str(tiny_checkpoint), data["rl"], str(tmp_path / "r.parquet"), rl, 0
    )
    designed = _designed_rollout(roll.path, str(tmp_path / "designed.parquet"))
    sc = score.fn(
        "rl_1", 0, designed, str(tmp_path / "s.parquet"), {"accuracy": 1.0, "format": 0.1}, rl
    )
    scored = pq.read_table(sc.path).to_pandas()
    first = scored["prompt_id"] == scored["prompt_id"].iloc[0]
    assert (scored.loc[first, "reward_accuracy"] == 1.0).all()
    assert scored.loc[~first, "reward_accuracy"].tolist() == [1.0, 0.0] * 12
    if options.get("overlong_buffer_length"):
        assert "reward_overlong_penalty" in scored.columns
        assert (scored["reward_overlong_penalty"] <= 0).all()
    else:
        assert scored.loc[first, "reward"].tolist() == pytest.approx([1.1] * 8)
    request = UpdateRequest(str(tiny_checkpoint), sc.path, str(tmp_path / "ckpt"), rl,
                            reference_checkpoint=str(tiny_checkpoint), stage="rl_1")  # fmt: skip
    up = update.fn(request, 0)
    assert len(up.history) == 2 * options.get("num_iterations", 1)
    before = load_file(Path(tiny_checkpoint) / "model.safetensors")
    after = load_file(Path(up.checkpoint) / "model.safetensors")
    assert any(not torch.equal(after[k], v) for k, v in before.items())
    for h in up.history:
        assert all(v == v for k, v in h.items() if k != "kl"), h  # no NaN metric
    if options.get("beta"):
        assert "kl" in up.history[0]
    if options.get("vllm_importance_sampling_correction"):
        # hf engine at the same weights: sampling and trainer log-probs agree to float error
        assert up.history[0]["sampling/sampling_logp_difference/max"] < 1e-3
    if options.get("bf16"):  # bf16 autocast against the float32 sampler: corrected (auto)
        assert 1e-4 < up.history[0]["sampling/sampling_logp_difference/max"] < 0.1
    if options.get("dynamic_sampling"):
        # the all-1.1 group carries no signal and is dropped; the three others are kept
        kept = [h["dynamic_sampling/kept_frac"] for h in up.history]
        assert kept == [pytest.approx(24 / 32)] * len(kept)
