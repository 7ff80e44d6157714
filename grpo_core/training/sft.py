"""Supervised fine-tuning on prompt/completion pairs, loss on completion tokens only.

Used for the cold start (worked examples) and for re-SFT on rejection-sampled completions;
what a row trains on (its ids and loss mask) is grpo_core/training/sft_examples.py's.
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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from grpo_core.config.settings import SFTSettings, settings_or_knobs
from grpo_core.logprobs.model import model_logprobs
from grpo_core.logprobs.precision import Precision
from grpo_core.training.checkpoint import TRAINER_STATE, load_trainer_state, save_checkpoint
from grpo_core.training.parallel import LOCAL, LocalParallel
from grpo_core.training.sft_examples import encode_examples
from grpo_core.training.train_state import TrainState, load_weights_, rng_state, set_rng_state

log = logging.getLogger(__name__)


@dataclass
class SFTResult:
    steps: int
    final_loss: float
    history: list[dict]  # per-step metrics
    dev_history: list[dict]  # {"step", "accuracy"} at each dev evaluation
    stopped_early: bool
    resumed_from: int = 0  # the step of the resume checkpoint this run continued from


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
        mask = getattr(c, "mask", None)
        if mask is not None:  # context tokens of the completion: no loss
            labels[i, len(p) : len(seq)][torch.tensor(mask) == 0] = -100
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


def target_tokens(labels: torch.Tensor) -> int:
    """The tokens a batch's loss predicts: its labels (not -100) after the first position."""
    return int((labels[:, 1:] >= 0).sum())


def sft_loss_backward(
    model,
    ids: torch.Tensor,
    attn: torch.Tensor,
    labels: torch.Tensor,
    *,
    max_tokens: int | None = None,
    lm_head: str = "chunked",
    precision: Precision | None = None,
    n_tokens: int | None = None,
) -> float:
    """Backward of the mean completion-token cross-entropy of the batch (labels -100 ignored,
    as ``model(labels=...).loss``), in row chunks of at most ``max_tokens`` padded tokens,
    each divided by the whole batch's token count: the gradient is the unsplit batch's.
    ``n_tokens``: that count when these rows are one rank's share of a larger batch.
    Returns the loss (this share's part of it)."""
    precision = precision or Precision()
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # [n, L] shifted
    n_tokens = max(target_tokens(labels) if n_tokens is None else n_tokens, 1)  # a Python int
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
    settings: SFTSettings | None = None,
    *,
    seed: int = 0,
    dev_eval: Callable[[], float] | None = None,
    on_step: Callable[[int, dict], None] | None = None,
    desc: str = "sft",
    resume_dir: str | Path | None = None,
    resume_key: str = "",
    on_resume: Callable[[int, list[dict]], None] | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
    parallel: LocalParallel = LOCAL,
    **knobs,
) -> SFTResult:
    """Train ``model`` in place with ``settings`` (an ``SFTSettings``, or its fields as
    keywords: ``max_steps``, ``batch_size``, ``learning_rate``, ...; not both).

    ``dev_eval()`` returns greedy dev accuracy in [0, 1], called every ``eval_every`` steps
    (with ``target_accuracy``: from ``min_steps`` on, since only those evals can stop
    training); training stops at the first that reaches the target.

    ``checkpoint_every`` K > 0 with ``resume_dir``: every K steps (not the last) the state is
    saved to ``resume_dir`` (a checkpoint directory, replaced atomically); when
    ``resume_dir`` holds a state saved with the same ``resume_key``, training continues from
    it and ``on_resume(step, history)`` gets the restored steps' metrics. A state with
    another key is ignored. The caller deletes ``resume_dir`` once its output is saved.
    ``logger``: where dev evals, checkpoints and resumes are reported (default: this
    module's logger).
    ``max_tokens_per_microbatch``: each batch's forward/backward runs in row chunks of at
    most this many padded tokens (same gradient). ``lm_head``, ``bf16``, ``fp16``: see
    :func:`grpo_core.logprobs.model.model_logprobs` and :mod:`grpo_core.logprobs.precision`; ``optim``:
    :func:`grpo_core.training.optim.build_optimizer`.

    ``parallel``: this rank of N (``grpo_core/training/distributed.py``, prepared: replicas equal, or
    sharded with FSDP2), each holding the whole data and drawing the same batches; a rank
    trains its contiguous share of each batch and the N ranks make the step of one process
    (gradients summed, the loss divided by the whole batch's tokens). Rank 0 alone writes
    resume checkpoints; sharded ranks write none (their state would need gathering).
    """
    s = settings_or_knobs(SFTSettings, settings, knobs)
    logger = logger or log
    if not rows:
        raise ValueError("SFT: no training rows")
    if parallel.sharded and s.fp16:
        raise ValueError("sft.fp16 with cluster.trainer.strategy: fsdp: use sft.bf16")
    data = encode_examples(tokenizer, rows, s.mask_spans)
    run = _Run.start(model, s, seed, parallel)
    if parallel.sharded and resume_dir is not None and s.checkpoint_every:
        logger.warning("%s: sharded ranks write no resume checkpoint (checkpoint_every)", desc)
        resume_dir = None
    resume_dir = Path(resume_dir) if resume_dir is not None else None
    if run.resume_from(model, resume_dir, resume_key, desc, logger) and on_resume is not None:
        on_resume(run.step, run.history)
    resumed_from, stopped = run.step, False
    model.train()
    with tqdm(total=s.max_steps, initial=run.step, desc=desc, unit="step", leave=False) as bar:
        while run.step < s.max_steps:
            metrics = run.train_step(model, data, tokenizer.pad_token_id)
            bar.update(1)
            bar.set_postfix(loss=f"{run.loss:.3f}")
            if dev_eval is not None and run.dev_eval_due():
                stopped = run.dev_eval(model, dev_eval, metrics, desc, logger)
            if on_step is not None:
                on_step(run.step, metrics)
            if stopped:
                break
            if resume_dir and run.resume_point():
                run.save(model, tokenizer, resume_dir, resume_key, desc, logger)
    model.eval()
    return SFTResult(run.step, run.loss, run.history, run.dev_history, stopped, resumed_from)


@dataclass
class _Run:
    """An SFT run between two steps: what a resume checkpoint saves, besides the weights."""

    settings: SFTSettings
    train: TrainState  # optimizer, schedule, loss scaler, step (grpo_core/training/train_state.py)
    precision: Precision
    data_rng: random.Random  # shuffles the data order, epoch by epoch
    parallel: LocalParallel  # one process, or this rank of N
    order: list[int] = field(default_factory=list)  # the data order's remaining indices
    history: list[dict] = field(default_factory=list)  # per-step metrics
    dev_history: list[dict] = field(default_factory=list)
    loss: float = float("nan")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.train.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.train.scheduler

    @property
    def step(self) -> int:
        return self.train.global_step

    @step.setter
    def step(self, value: int) -> None:
        self.train.global_step = value

    @classmethod
    def start(cls, model, s: SFTSettings, seed: int, parallel: LocalParallel = LOCAL) -> _Run:
        """Step 0: the RNGs seeded from ``seed``, a fresh optimizer and schedule."""
        data_rng = random.Random(seed)
        torch.manual_seed(seed)
        precision = Precision.for_model(model, bf16=s.bf16, fp16=s.fp16, section="sft")
        opt, sched = s.optimization.build(model, total_steps=s.max_steps, section="sft")
        train = TrainState({"stage": "sft"}, opt, sched, 0, {}, precision.scaler, model)
        return cls(s, train, precision, data_rng, parallel)

    def resume_from(self, model, resume_dir: Path | None, key: str, desc: str, logger) -> bool:
        """Continue from the state in ``resume_dir`` when one was saved with ``key``."""
        state = _resume_state(resume_dir, key, desc, logger)
        if state is None:
            return False
        self.resume(model, resume_dir, state)
        steps = self.settings.max_steps
        logger.info("%s: resumed at step %d of %d from %s", desc, self.step, steps, resume_dir)
        return True

    def resume(self, model, resume_dir: Path, state: dict) -> None:
        """Continue from a resume checkpoint: its weights, optimizer, data order and RNGs."""
        load_weights_(model, resume_dir)
        self.optimizer.load_state_dict(state["optimizer"])  # after the scheduler set step 0's lr
        self.scheduler.load_state_dict(state["scheduler"])
        if self.precision.scaler is not None and state.get("grad_scaler"):
            self.precision.scaler.load_state_dict(state["grad_scaler"])
        self.data_rng.setstate(state["data_rng"])
        self.order, self.step = list(state["order"]), state["step"]
        self.history, self.dev_history = state["history"], state["dev_history"]
        self.loss = state["loss"]
        set_rng_state(state["rng"])

    def train_step(self, model, data: list, pad_id: int) -> dict:
        """One optimizer step on the next batch of the shuffled data; its metrics."""
        s = self.settings
        if len(self.order) < s.batch_size:
            perm = list(range(len(data)))
            self.data_rng.shuffle(perm)
            self.order.extend(perm)
        batch = [data[self.order.pop()] for _ in range(min(s.batch_size, len(data)))]
        self.optimizer.zero_grad(set_to_none=True)
        self.loss = self.backward(model, batch, pad_id)
        self.precision.unscale_(self.optimizer)
        grad_norm = self.parallel.clip_grad_norm(model, s.max_grad_norm)
        scaled = self.precision.step(self.optimizer)
        if not scaled.get("grad_scaler/skipped"):  # as HF Trainer: a skipped step keeps its lr
            self.scheduler.step()
        self.step += 1
        metrics = {
            "loss": self.loss,
            "grad_norm": float(grad_norm),
            "learning_rate": self.scheduler.get_last_lr()[0],
            **scaled,
        }
        self.history.append(metrics)
        return metrics

    def backward(self, model, batch: list, pad_id: int) -> float:
        """The batch's loss and its gradient; on ranks, of this rank's share, then summed
        (FSDP2: every rank runs as many sharded forwards as the busiest)."""
        s, dp = self.settings, self.parallel
        if dp.world_size == 1:
            ids, attn, labels = (t.to(model.device) for t in collate(batch, pad_id))
            return sft_loss_backward(model, ids, attn, labels, max_tokens=s.max_tokens_per_microbatch,
                                     lm_head=s.lm_head, precision=self.precision)  # fmt: skip
        n_tokens = target_tokens(collate(batch, pad_id)[2])  # the whole batch's
        mine = [batch[i] for i in dp.row_share(len(batch))]
        loss, chunks = 0.0, 0
        if dp.sharded:
            dp.forwards = 0  # a dev eval's generation ran forwards that no plan counted
        if mine:
            ids, attn, labels = (t.to(model.device) for t in collate(mine, pad_id))
            chunks = len(row_chunks(attn, s.max_tokens_per_microbatch))
        target = dp.agree([chunks])[0] if dp.sharded else 0
        if mine:
            loss = sft_loss_backward(model, ids, attn, labels, max_tokens=s.max_tokens_per_microbatch,
                                     lm_head=s.lm_head, precision=self.precision,
                                     n_tokens=n_tokens)  # fmt: skip
        if dp.sharded:
            dp.pad_to(model, target, grad=True)
        dp.all_reduce_gradients(model)
        return dp.sum_scalar(loss)

    def dev_eval_due(self) -> bool:
        """With a target, dev evals start at ``min_steps``: an earlier one cannot stop training."""
        s = self.settings
        return self.step % s.eval_every == 0 and (
            s.target_accuracy is None or self.step >= s.min_steps
        )

    def dev_eval(self, model, dev_eval: Callable[[], float], metrics: dict, desc, logger) -> bool:
        """Evaluate on the dev split, record it in ``metrics``; whether the target is reached."""
        acc = dev_eval()
        model.train()
        self.dev_history.append({"step": self.step, "accuracy": acc})
        metrics["dev/accuracy"] = acc
        logger.info("%s step %d: loss %.4f, dev accuracy %.3f", desc, self.step, self.loss, acc)
        target = self.settings.target_accuracy
        return target is not None and self.step >= self.settings.min_steps and acc >= target

    def resume_point(self) -> bool:
        """Whether to save a resume checkpoint now (the last step's state is the stage's
        output, not a resume point)."""
        every, step = self.settings.checkpoint_every, self.step
        return bool(every) and step % every == 0 and step < self.settings.max_steps

    def save(self, model, tokenizer, resume_dir: Path, key: str, desc: str, logger) -> None:
        """The weights and this state to ``resume_dir``, for a rerun with the same ``key``
        (written by rank 0; every rank waits for it)."""
        if self.parallel.rank == 0:
            self._write(model, tokenizer, resume_dir, key, desc)
            steps = self.settings.max_steps
            logger.info("%s: resume checkpoint at step %d of %d", desc, self.step, steps)
        self.parallel.barrier()

    def _write(self, model, tokenizer, resume_dir: Path, key: str, desc: str) -> None:
        state = {
            "kind": SFT_STATE,
            "key": key,
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data_rng": self.data_rng.getstate(),
            "order": list(self.order),
            "history": self.history,
            "dev_history": self.dev_history,
            "loss": self.loss,
            "rng": rng_state(),
        }
        if self.precision.scaler is not None:  # fp16: the loss scale goes on from here
            state["grad_scaler"] = self.precision.scaler.state_dict()
        info = {"stage": desc, "step": self.step, "resume_key": key}
        save_checkpoint(model, tokenizer, resume_dir, trainer_state=state, info=info)


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
