import copy
import json

import pytest
import torch

from grpo_core.algorithm.update import batched_logprobs, build_batch, grpo_update
from grpo_core.config.loss import LossConfig, UpdateConfig
from grpo_core.demo.task import make_splits
from grpo_core.training.sft import collate, train_sft
from grpo_core.training.sft_examples import encode_examples


def test_collate_masks_prompt_and_padding(tiny_model):
    _, tok = tiny_model
    rows = make_splits(0, n_sft=2, n_rl=1, n_dev=1, n_eval=1).sft
    pairs = encode_examples(tok, rows)
    ids, attn, labels = collate(pairs, tok.pad_token_id)
    for i, (p, c) in enumerate(pairs):
        assert (labels[i, : len(p)] == -100).all()
        assert labels[i, len(p) : len(p) + len(c)].tolist() == c
        assert (labels[i, len(p) + len(c) :] == -100).all()
        assert attn[i].sum() == len(p) + len(c)
        assert c[-1] == tok.eos_token_id


def test_sft_reduces_completion_loss(tiny_model):
    model, tok = tiny_model
    rows = make_splits(0, n_sft=64, n_rl=1, n_dev=1, n_eval=1).sft
    res = train_sft(model, tok, rows, max_steps=40, batch_size=16, learning_rate=3e-3, seed=0)
    assert res.steps == 40
    first = sum(h["loss"] for h in res.history[:5]) / 5
    last = sum(h["loss"] for h in res.history[-5:]) / 5
    assert last < 0.7 * first


def test_sft_stops_at_dev_target(tiny_model):
    model, tok = tiny_model
    rows = make_splits(0, n_sft=8, n_rl=1, n_dev=1, n_eval=1).sft
    calls = iter([0.1, 0.2, 0.9, 0.95])
    res = train_sft(
        model,
        tok,
        rows,
        max_steps=100,
        batch_size=4,
        learning_rate=1e-3,
        dev_eval=lambda: next(calls),
        target_accuracy=0.5,
        eval_every=5,
    )
    assert res.stopped_early and res.steps == 15
    assert [d["accuracy"] for d in res.dev_history] == [0.1, 0.2, 0.9]


def test_sft_dev_evals_start_at_min_steps(tiny_model):
    """With a target, a dev eval before min_steps could not stop training: none is run."""
    model, tok = tiny_model
    rows = make_splits(0, n_sft=8, n_rl=1, n_dev=1, n_eval=1).sft
    calls = iter([0.9, 0.1, 0.95])
    res = train_sft(
        model,
        tok,
        rows,
        max_steps=30,
        batch_size=4,
        learning_rate=1e-3,
        dev_eval=lambda: next(calls),
        target_accuracy=0.5,
        eval_every=5,
        min_steps=12,
    )
    assert [d["step"] for d in res.dev_history] == [15]
    assert res.stopped_early and res.steps == 15


def _batch(tok, advantages):
    prompts = [[3, 12, 13, 4]] * len(advantages)
    completions = [
        [5, 12, 6, 7, 13, 8, 2],
        [5, 13, 6, 7, 12, 8, 2],
        [5, 12, 12, 6, 2],
        [5, 6, 7, 8, 2],
    ]
    return build_batch(prompts, completions[: len(advantages)], advantages, tok.pad_token_id)


def test_update_moves_probability_towards_positive_advantage(tiny_model):
    model, tok = tiny_model
    batch = _batch(tok, [1.0, -1.0, 1.0, -1.0])
    before = batched_logprobs(model, batch, temperature=1.0)
    seq_before = (before * batch.completion_mask).sum(-1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    cfg = UpdateConfig(steps_per_generation=1, num_iterations=3)
    hist = grpo_update(model, opt, None, batch, cfg)
    after = batched_logprobs(model, batch, temperature=1.0)
    seq_after = (after * batch.completion_mask).sum(-1)
    delta = seq_after - seq_before
    assert delta[0] > 0 and delta[2] > 0
    assert delta[1] < 0 and delta[3] < 0
    assert len(hist) == 3
    assert {
        "loss",
        "entropy",
        "grad_norm",
        "learning_rate",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
    } <= set(hist[0])


def test_zero_advantages_leave_weights_unchanged(tiny_model):
    model, tok = tiny_model
    ref = copy.deepcopy(model.state_dict())
    batch = _batch(tok, [0.0, 0.0, 0.0, 0.0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    grpo_update(model, opt, None, batch, UpdateConfig(steps_per_generation=2))
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_update_never_splits_a_group_and_refuses_interleaved_ones(tiny_model):
    model, tok = tiny_model
    prompts, completions = [[3, 12, 13, 4]] * 6, [[5, 12, 6, 2], [5, 13, 2], [5, 6, 7, 2]] * 2
    adv = [1.0, -1.0, 0.5, -0.5, 0.3, -0.3]
    # three groups of two: two micro-batches hold whole groups, [0, 1, 2, 3] and [4, 5]
    batch = build_batch(prompts, completions, adv, tok.pad_token_id, group_ids=[0, 0, 1, 1, 2, 2])
    assert [s.tolist() for s in batch.step_slices(2)] == [[0, 1, 2, 3], [4, 5]]
    opt = torch.optim.AdamW(model.parameters())
    assert len(grpo_update(model, opt, None, batch, UpdateConfig(steps_per_generation=2))) == 2
    # a group whose rows are not contiguous would be trained in two steps: refused
    mixed = build_batch(prompts, completions, adv, tok.pad_token_id, group_ids=[0, 1, 0, 1, 2, 2])
    with pytest.raises(ValueError, match="contiguous"):
        grpo_update(model, opt, None, mixed, UpdateConfig(steps_per_generation=2))
    # without group ids every row is its own group: 3 rows do not make 2 equal steps
    with pytest.raises(ValueError, match="does not split"):
        _batch(tok, [1.0, -1.0, 0.5]).step_slices(2)
    with pytest.raises(ValueError, match="reference model"):
        grpo_update(
            model, opt, None, _batch(tok, [1.0, -1.0]), UpdateConfig(loss=LossConfig(beta=0.1))
        )


def test_kl_metric_with_reference(tiny_model):
    model, tok = tiny_model
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = _batch(tok, [1.0, -1.0, 1.0, -1.0])
    cfg = UpdateConfig(steps_per_generation=1, num_iterations=3, loss=LossConfig(beta=0.1))
    hist = grpo_update(model, opt, None, batch, cfg, ref_model=ref)
    assert hist[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # identical weights at the first step
    assert hist[-1]["kl"] > 0


# --- resume: a stage continued from its files trains exactly like an uninterrupted one ---


class _Killed(Exception):
    """Stands in for SIGKILL: training stops between two steps."""


def _dev_eval(model, tok, rows):
    """A deterministic dev "accuracy" that grows as training goes: exp(-completion loss)."""

    def f() -> float:
        ids, attn, labels = collate(encode_examples(tok, rows), tok.pad_token_id)
        with torch.no_grad():
            return float(torch.exp(-model(input_ids=ids, attention_mask=attn, labels=labels).loss))

    return f


def _sft(model, tok, rows, dev_rows, resume_dir, *, target=None, kill_at=None, key="k"):
    def on_step(step, _):
        if step == kill_at:
            raise _Killed

    return train_sft(
        model,
        tok,
        rows,
        max_steps=24,
        batch_size=16,
        learning_rate=3e-3,
        warmup_steps=5,
        seed=3,
        dev_eval=_dev_eval(model, tok, dev_rows),
        target_accuracy=target,
        eval_every=4,
        on_step=on_step,
        checkpoint_every=5,
        resume_dir=resume_dir,
        resume_key=key,
    )


def _weights_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("early_stop", [False, True])
def test_sft_resumed_after_a_kill_ends_bit_identical(tiny_checkpoint, tmp_path, early_stop):
    from grpo_core.training.checkpoint import load_checkpoint

    sft_rows = make_splits(1, n_sft=40, n_rl=1, n_dev=1, n_eval=1).sft
    rows, dev = sft_rows[:34], sft_rows[34:]  # dev rows with completions (for their loss)
    ref_model, tok = load_checkpoint(tiny_checkpoint)
    ref = _sft(ref_model, tok, rows, dev, None)
    target = None
    if early_stop:  # a target that the uninterrupted run reaches at its 4th dev eval (step 16)
        target = ref.dev_history[3]["accuracy"]
        assert all(d["accuracy"] < target for d in ref.dev_history[:3])
        ref_model, tok = load_checkpoint(tiny_checkpoint)
        ref = _sft(ref_model, tok, rows, dev, None, target=target)
        assert ref.stopped_early and ref.steps == 16

    resume = tmp_path / "resume"
    model, _ = load_checkpoint(tiny_checkpoint)
    with pytest.raises(_Killed):
        _sft(model, tok, rows, dev, resume, target=target, kill_at=13)
    assert json.loads((resume / "checkpoint_info.json").read_text())["step"] == 10
    model, _ = load_checkpoint(tiny_checkpoint)  # a new process: the initial weights again
    out = _sft(model, tok, rows, dev, resume, target=target)
    assert out.resumed_from == 10
    assert _weights_equal(model, ref_model)
    assert (out.steps, out.stopped_early) == (ref.steps, ref.stopped_early)
    assert out.history == ref.history and out.dev_history == ref.dev_history

    # a state saved for other settings or inputs (another cache key) is not resumed from
    model, _ = load_checkpoint(tiny_checkpoint)
    other = _sft(model, tok, rows, dev, resume, target=target, key="other")
    assert other.resumed_from == 0


def test_sft_without_checkpoint_every_writes_no_resume_state(tiny_model, tmp_path):
    model, tok = tiny_model
    rows = make_splits(0, n_sft=8, n_rl=1, n_dev=1, n_eval=1).sft
    res = train_sft(
        model, tok, rows, max_steps=6, batch_size=4, learning_rate=1e-3, resume_dir=tmp_path / "r"
    )
    assert res.steps == 6 and not (tmp_path / "r").exists()


def column_reward(prompts, completions, r, **_):
    return list(r)


def _scored_file(tmp_path, name: str, shift: int) -> str:
    """A scored file of 2 groups x 4 completions with rewards that vary within groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.score import score_file

    rows = []
    for g in range(2):
        for s in range(4):
            n = 3 + (s + shift) % 3
            rows.append(
                {
                    "prompt_id": f"p{g}",
                    "group_idx": g,
                    "sample_idx": s,
                    "prompt": f"{g}+{g}=",
                    "prompt_text": f"{g}+{g}=",
                    "completion": "x" * n,
                    "prompt_ids": [3, 4 + g, 5],
                    "completion_ids": [6 + (s + k + shift) % 5 for k in range(n)] + [2],
                    "completion_logprobs": [-1.0] * (n + 1),
                    "completion_length": n + 1,
                    "finish_reason": "stop",
                    "policy_id": "p",
                    "iteration": 0,
                    "r": float((s + shift + g) % 2),
                }
            )
    rollouts = tmp_path / f"{name}-rollouts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), rollouts)
    out = tmp_path / f"{name}-scored.parquet"
    score_file(str(rollouts), str(out), {f"{__file__}:column_reward": 1.0})
    return str(out)


def _adam_step(ckpt) -> float:
    from grpo_core.training.checkpoint import load_trainer_state

    state = load_trainer_state(ckpt)["optimizer"]["state"]
    return float(next(iter(state.values()))["step"])


def test_rl_stage_resumed_from_disk_continues_its_own_optimizer(tiny_checkpoint, tmp_path):
    """Three iterations of one stage in one process (the warm path) against the same stage
    resumed from disk before its last iteration; then a second stage on the same weights
    starts its own AdamW instead of continuing the first stage's."""
    from grpo_core.config.stages import RLConfig
    from grpo_core.training.checkpoint import file_sha256, load_trainer_state
    from tasks.policies.trainer import open_trainer
    from tasks.update import UpdateRequest, update_from_file

    rl = RLConfig(
        prompts_per_iteration=2,
        num_generations=4,
        steps_per_generation=2,
        learning_rate=1e-2,
        warmup_steps=2,
        lr_scheduler_type="cosine",
    )
    scored = [_scored_file(tmp_path, f"it{i}", i) for i in range(3)]
    init = str(tiny_checkpoint)

    def run(it, policy, out, step, stage="rl_1", first=init):
        up = update_from_file(
            UpdateRequest(
                policy,
                scored[it],
                out,
                rl,
                stage=stage,
                init_checkpoint=first,
                global_step=step,
                total_steps=6,
            )
        )
        assert up.peak_memory_gib > 0  # logged with every step of the update
        assert all(h["peak_memory_gib"] == up.peak_memory_gib for h in up.history)
        return up.checkpoint, up.global_step

    open_trainer().forget()
    policy, step = init, 0
    for it in range(3):
        policy, step = run(it, policy, str(tmp_path / f"warm{it}"), step)
    assert step == 6 and _adam_step(policy) == 6

    open_trainer().forget()  # a new process after a crash: the state comes from iteration 1's files
    resumed, _ = run(2, str(tmp_path / "warm1"), str(tmp_path / "resumed2"), 4)
    w_a, w_b = (file_sha256(f"{p}/model.safetensors") for p in (policy, resumed))
    assert w_a == w_b
    a, b = load_trainer_state(policy), load_trainer_state(resumed)
    assert a["scheduler"] == b["scheduler"] and a["optimizer_key"] == b["optimizer_key"]
    for k, s in a["optimizer"]["state"].items():
        assert all(torch.equal(s[n], b["optimizer"]["state"][k][n]) for n in s)

    # another stage starting from the warm weights: a fresh optimizer, whatever is in memory
    open_trainer().forget()
    run(0, init, str(tmp_path / "a0"), 0)
    a0 = str(tmp_path / "a0")
    other, step = run(1, a0, str(tmp_path / "b0"), 0, stage="rl_2", first=a0)
    assert _adam_step(other) == 2 and step == 2
    other, step = run(2, other, str(tmp_path / "b1"), step, stage="rl_2", first=a0)
    assert _adam_step(other) == 4 and step == 4
