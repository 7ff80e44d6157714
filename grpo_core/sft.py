"""Supervised fine-tuning on prompt/completion pairs, loss on completion tokens only.

Used for the cold start (worked examples) and for re-SFT on rejection-sampled completions.
Optionally stops early once greedy accuracy on a dev split reaches a target, so the RL
stage starts inside the band where groups have reward variance.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from grpo_core.schedule import lr_lambda
from grpo_core.text import encode_completion, encode_prompt

log = logging.getLogger(__name__)


@dataclass
class SFTResult:
    steps: int
    final_loss: float
    history: list[dict]  # per-step metrics
    dev_history: list[dict]  # {"step", "accuracy"} at each dev evaluation
    stopped_early: bool


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
) -> SFTResult:
    """Train ``model`` in place. ``dev_eval()`` returns greedy dev accuracy in [0, 1]."""
    if not rows:
        raise ValueError("SFT: no training rows")
    data = encode_examples(tokenizer, rows)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup_steps, max_steps))
    model.train()
    order: list[int] = []
    history, dev_history = [], []
    loss_val, stopped = float("nan"), False
    step = 0
    with tqdm(total=max_steps, desc=desc, unit="step", leave=False) as bar:
        while step < max_steps:
            if len(order) < batch_size:
                perm = list(range(len(data)))
                rng.shuffle(perm)
                order.extend(perm)
            batch = [data[order.pop()] for _ in range(min(batch_size, len(data)))]
            ids, attn, labels = collate(batch, tokenizer.pad_token_id)
            ids, attn, labels = ids.to(model.device), attn.to(model.device), labels.to(model.device)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            sched.step()
            step += 1
            loss_val = float(loss.detach())
            metrics = {
                "loss": loss_val,
                "grad_norm": float(grad_norm),
                "learning_rate": sched.get_last_lr()[0],
            }
            history.append(metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_val:.3f}")
            if dev_eval is not None and step % eval_every == 0:
                acc = dev_eval()
                model.train()
                dev_history.append({"step": step, "accuracy": acc})
                metrics["dev/accuracy"] = acc
                log.info("%s step %d: loss %.4f, dev accuracy %.3f", desc, step, loss_val, acc)
                if target_accuracy is not None and step >= min_steps and acc >= target_accuracy:
                    stopped = True
            if on_step is not None:
                on_step(step, metrics)
            if stopped:
                break
    model.eval()
    return SFTResult(step, loss_val, history, dev_history, stopped)
