"""Supervised fine-tuning on prompt/completion pairs, loss on completion tokens only.

Used for the cold start (worked examples) and for re-SFT on rejection-sampled completions.
Optionally stops early once greedy accuracy on a dev split reaches a target, so the RL
stage starts inside the band where groups have reward variance.

With ``checkpoint_every`` and ``resume_dir``, the loop saves a resume checkpoint every K
steps (weights, AdamW, schedule, RNG states, data order, step and dev-eval history) and a
rerun with the same ``resume_key`` continues from it: the resumed run ends with the same
weights, bit for bit, as one that was never interrupted.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from grpo_core.checkpoint import TRAINER_STATE, load_trainer_state, save_checkpoint
from grpo_core.model_logprobs import model_logprobs
from grpo_core.precision import Precision
from grpo_core.text import encode_completion, encode_prompt
from grpo_core.trainer import build_optimization
from grpo_core.trainer_state import load_weights_, rng_state, set_rng_state

log = logging.getLogger(__name__)


@dataclass
class SFTResult:
    steps: int
    final_loss: float
    history: list[dict]  # per-step metrics
    dev_history: list[dict]  # {"step", "accuracy"} at each dev evaluation
    stopped_early: bool
    resumed_from: int = 0  # the step of the resume checkpoint this run continued from


def encode_examples(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, completion_ids + eos) for rows with ``prompt`` and ``completion``."""
    out = []
    for i, row in enumerate(rows):
        if "prompt" not in row or "completion" not in row:
            raise ValueError(f"SFT row {i}: needs 'prompt' and 'completion', has {sorted(row)}")
        out.append(
            (
                encode_prompt(tokenizer, row["prompt"]),
                encode_completion(tokenizer, row["completion"]),
            )
        )
    return out


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded input_ids, attention_mask and labels (-100 on prompt and padding)."""
    L = max(len(p) + len(c) for p, c in pairs)
    ids = torch.full((len(pairs), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(pairs), L), dtype=torch.long)
    labels = torch.full((len(pairs), L), -100, dtype=torch.long)
    for i, (p, c) in enumerate(pairs):
        seq = p + c
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        labels[i, len(p) : len(seq)] = torch.tensor(c)
    return ids, attn, labels


def row_chunks(attention_mask: torch.Tensor, max_tokens: int | None) -> list[slice]:
    """Consecutive row ranges of a right-padded batch whose size (rows x longest row among
    them) is at most ``max_tokens`` (a longer row alone is a chunk by itself)."""
    n = attention_mask.shape[0]
    if max_tokens is None:
        return [slice(0, n)]
    lengths = attention_mask.sum(-1).tolist()
    chunks, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and (i - start + 1) * max(longest, length) > max_tokens:
            chunks.append(slice(start, i))
            start, longest = i, 0
        longest = max(longest, length)
    chunks.append(slice(start, n))
    return chunks


def sft_loss_backward(
    model,
    ids: torch.Tensor,
    attn: torch.Tensor,
    labels: torch.Tensor,
    *,
    max_tokens: int | None = None,
    lm_head: str = "chunked",
    precision: Precision | None = None,
) -> float:
    """Backward of the mean completion-token cross-entropy of the batch (labels -100 ignored,
    as ``model(labels=...).loss``), in row chunks of at most ``max_tokens`` padded tokens,
    each divided by the whole batch's token count: the gradient is the unsplit batch's.
    Returns the loss."""
    precision = precision or Precision()
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # [n, L] shifted
    n_tokens = (targets >= 0).sum().clamp(min=1)
    total = 0.0
    for rows in row_chunks(attn, max_tokens):
        width = max(1, int(attn[rows].sum(-1).max()))  # right padding beyond it is dropped
        with precision.autocast():
            logp, _ = model_logprobs(
                model,
                ids[rows, :width],
                attn[rows, :width],
                targets[rows, :width],
                lm_head=lm_head,
            )  # [c, width]
        loss = -logp.sum() / n_tokens
        precision.backward(loss)
        total += float(loss.detach())
    return total


SFT_STATE = "sft"  # ``kind`` of an SFT resume checkpoint's trainer state


def train_sft(
    model,
    tokenizer,
    rows: list[dict],
    *,
    max_steps: int,
    batch_size: int,
    learning_rate: float,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    dev_eval: Callable[[], float] | None = None,
    target_accuracy: float | None = None,
    eval_every: int = 100,
    min_steps: int = 0,
    on_step: Callable[[int, dict], None] | None = None,
    desc: str = "sft",
    checkpoint_every: int = 0,
    resume_dir: str | Path | None = None,
    resume_key: str = "",
    on_resume: Callable[[int, list[dict]], None] | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
    max_tokens_per_microbatch: int | None = None,
    lm_head: str = "chunked",
    bf16: bool = False,
    fp16: bool = False,
    optim: str = "adamw_torch",
) -> SFTResult:
    """Train ``model`` in place. ``dev_eval()`` returns greedy dev accuracy in [0, 1], called
    every ``eval_every`` steps (with ``target_accuracy``: from ``min_steps`` on, since only
    those evals can stop training); training stops at the first that reaches the target.

    ``checkpoint_every`` K > 0 with ``resume_dir``: every K steps (not the last) the state is
    saved to ``resume_dir`` (a checkpoint directory, replaced atomically); when
    ``resume_dir`` holds a state saved with the same ``resume_key``, training continues from
    it and ``on_resume(step, history)`` gets the restored steps' metrics. A state with
    another key is ignored. The caller deletes ``resume_dir`` once its output is saved.
    ``logger``: where dev evals, checkpoints and resumes are reported (default: this
    module's logger).
    ``max_tokens_per_microbatch``: each batch's forward/backward runs in row chunks of at
    most this many padded tokens (same gradient). ``lm_head``, ``bf16``, ``fp16``: see
    :func:`grpo_core.model_logprobs.model_logprobs` and :mod:`grpo_core.precision`; ``optim``:
    :func:`grpo_core.optim.build_optimizer`.
    """
    logger = logger or log
    if not rows:
        raise ValueError("SFT: no training rows")
    data = encode_examples(tokenizer, rows)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    precision = Precision.for_model(model, bf16=bf16, fp16=fp16, section="sft")
    opt, sched = build_optimization(
        model,
        optim,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        warmup_steps=warmup_steps,
        total_steps=max_steps,
        section="sft",
    )
    order: list[int] = []
    history, dev_history = [], []
    loss_val, stopped = float("nan"), False
    step = 0
    resume_dir = Path(resume_dir) if resume_dir is not None else None
    state = _resume_state(resume_dir, resume_key, desc, logger)
    if state is not None:
        load_weights_(model, resume_dir)
        opt.load_state_dict(state["optimizer"])  # after the scheduler set lr to step 0's
        sched.load_state_dict(state["scheduler"])
        rng.setstate(state["data_rng"])
        order, step = list(state["order"]), state["step"]
        history, dev_history = state["history"], state["dev_history"]
        loss_val = state["loss"]
        set_rng_state(state["rng"])
        logger.info("%s: resumed at step %d of %d from %s", desc, step, max_steps, resume_dir)
        if on_resume is not None:
            on_resume(step, history)
    resumed_from = step
    model.train()
    with tqdm(total=max_steps, initial=step, desc=desc, unit="step", leave=False) as bar:
        while step < max_steps:
            if len(order) < batch_size:
                perm = list(range(len(data)))
                rng.shuffle(perm)
                order.extend(perm)
            batch = [data[order.pop()] for _ in range(min(batch_size, len(data)))]
            ids, attn, labels = collate(batch, tokenizer.pad_token_id)
            ids, attn, labels = ids.to(model.device), attn.to(model.device), labels.to(model.device)
            opt.zero_grad(set_to_none=True)
            loss_val = sft_loss_backward(
                model,
                ids,
                attn,
                labels,
                max_tokens=max_tokens_per_microbatch,
                lm_head=lm_head,
                precision=precision,
            )
            precision.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            precision.step(opt)
            sched.step()
            step += 1
            metrics = {
                "loss": loss_val,
                "grad_norm": float(grad_norm),
                "learning_rate": sched.get_last_lr()[0],
            }
            history.append(metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_val:.3f}")
            # with a target, dev evals start at min_steps: an earlier one cannot stop training
            if (
                dev_eval is not None
                and step % eval_every == 0
                and (target_accuracy is None or step >= min_steps)
            ):
                acc = dev_eval()
                model.train()
                dev_history.append({"step": step, "accuracy": acc})
                metrics["dev/accuracy"] = acc
                logger.info("%s step %d: loss %.4f, dev accuracy %.3f", desc, step, loss_val, acc)
                if target_accuracy is not None and step >= min_steps and acc >= target_accuracy:
                    stopped = True
            if on_step is not None:
                on_step(step, metrics)
            if stopped:
                break
            # the last step's state is the stage's output, not a resume point
            if (
                resume_dir
                and checkpoint_every
                and step % checkpoint_every == 0
                and step < max_steps
            ):
                state = {
                    "kind": SFT_STATE,
                    "key": resume_key,
                    "step": step,
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "data_rng": rng.getstate(),
                    "order": list(order),
                    "history": history,
                    "dev_history": dev_history,
                    "loss": loss_val,
                    "rng": rng_state(),
                }
                save_checkpoint(
                    model,
                    tokenizer,
                    resume_dir,
                    trainer_state=state,
                    info={"stage": desc, "step": step, "resume_key": resume_key},
                )
                logger.info("%s: resume checkpoint at step %d of %d", desc, step, max_steps)
    model.eval()
    return SFTResult(step, loss_val, history, dev_history, stopped, resumed_from)


def _resume_state(resume_dir: Path | None, key: str, desc: str, logger) -> dict | None:
    """The resume state in ``resume_dir`` when it was saved for ``key``; else None."""
    if resume_dir is None or not (resume_dir / TRAINER_STATE).exists():
        return None
    state = load_trainer_state(resume_dir)
    if not isinstance(state, dict) or state.get("kind") != SFT_STATE:
        logger.warning("%s: %s holds no SFT resume state; starting at step 0", desc, resume_dir)
        return None
    if state.get("key") != key:
        logger.info(
            "%s: %s was saved for other inputs or settings; starting at step 0", desc, resume_dir
        )
        return None
    return state
