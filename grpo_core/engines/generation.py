"""The ``hf`` rollout engine: batched sampling with a KV cache and left padding.

All prompts x ``n`` samples go through the model in micro-batches of at most ``batch_size``
sequences (and, when ``max_batch_tokens`` is set, at most that many prompt + completion
tokens). Each step feeds only the newest token (the KV cache holds the rest), samples from
the adjusted distribution, and records the log-probability of the sampled token under that
same distribution, and under the policy's own temperature-scaled softmax when the
distribution was processed (grpo_core/engines/token_logprobs.py). Only a [batch, vocab]
slice of logits exists at a time.

Logits are adjusted in vLLM's order: repetition penalty (on prompt and completion tokens)
-> temperature -> min-p -> top-k -> top-p. A sequence stops on an EOS token or when its
decoded completion (special tokens kept) contains a stop string (the completing token is
kept, as in vLLM's ``token_ids``), or at ``max_new_tokens``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from grpo_core.config.settings import SamplingParams  # noqa: F401  (imported from here too)
from grpo_core.config.stages import DEFAULT_MAX_BATCH_TOKENS
from grpo_core.engines.decode_step import (
    DecodeBatch,
    count_prefill,
    keeps_last_logits,
    left_pad,
    next_tokens,
    repetition_penalty,
    seen_tokens,
)
from grpo_core.engines.token_logprobs import Completions, processes_distribution


@dataclass
class Sample:
    """One completion of one prompt."""

    prompt_index: int
    sample_index: int
    completion_ids: list[int]
    logprobs: list[float]  # sampling policy's logprob of each completion token
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    # which completion tokens the model wrote (1) and which an environment added (0, no
    # loss); None: all of them the model's (one turn: grpo_core/engines/turns.py)
    loss_mask: list[int] | None = None
    # the episode's turns in order, each {"role", "start", "end"} (token span of the
    # completion); None: one assistant turn spanning the completion
    turns: list[dict] | None = None
    # the environment's own reward for the episode ({"reward", "error"}: its episode's
    # ``reward()``, grpo_core/engines/turns.py); None: the episode has no reward()
    env: dict | None = None
    # the policy's log-prob of each completion token under its temperature-scaled softmax,
    # before the sampler's processing (top-p, top-k, min-p, repetition penalty); None: the
    # distribution was not processed, and ``logprobs`` are that already
    policy_logprobs: list[float] | None = None
    # the episode's own prompt when its environment's reset() added to it (ids, and the
    # prompt in the data's form: grpo_core/engines/openings.py); None: the prompt as given
    prompt_ids: list[int] | None = None
    prompt: Any = None


def _stop_string_hits(stop_hits, gen: list[list[int]], rows, active, tok, device) -> torch.Tensor:
    """Append each active row's token to its completion so far (``gen``) and say which rows'
    completions now contain a stop string. rows, active, tok: [b]; returns [b] bool."""
    row_list, active_list = rows.tolist(), active.tolist()
    for r, a, tk in zip(row_list, active_list, tok.tolist(), strict=True):
        if a:
            gen[r].append(tk)
    hits = stop_hits([gen[r] if a else [] for r, a in zip(row_list, active_list, strict=True)])
    return torch.tensor(hits, dtype=torch.bool, device=device)


@torch.no_grad()
def _generate_batch(
    model: PreTrainedModel, batch: DecodeBatch
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """One micro-batch. ``batch.turn`` (grpo_core/engines/turn_cache.py): the episodes' KV
    kept from their earlier turns (only the tokens after it are fed) and kept again for the
    next. ``batch.budgets``: each row's own most new tokens (a row that reaches it finishes,
    length)."""
    prompts, params, pad_id, generator = batch.prompts, batch.params, batch.pad_id, batch.generator
    stop_hits, stats, turn, budgets = batch.stop_hits, batch.stats, batch.turn, batch.budgets
    eos_ids = batch.eos_ids
    device = model.device
    B = len(prompts)
    input_ids, prompt_attn = left_pad(prompts, pad_id, device)
    live = _Live(input_ids, prompt_attn, turn, pad_id)
    count_prefill(stats, live.attn[:, -live.ids.shape[1] :])
    eos = torch.tensor(sorted(eos_ids), device=device)
    out = Completions(
        B, params.max_new_tokens, pad_id, device, policy=processes_distribution(params)
    )
    gen: list[list[int]] = [[] for _ in range(B)]  # completions so far (stop strings)
    budget = None if budgets is None else torch.tensor(budgets, device=device)  # [B]
    last_only = {"logits_to_keep": 1} if keeps_last_logits(model) else {}
    for t in range(params.max_new_tokens):
        # the prompt's forward: the head on its last position only
        logits = raw = live.forward(model, last_only)  # [b, V]
        if params.repetition_penalty != 1.0:
            if live.seen is None:  # the first step: the prompts' tokens, no padding
                live.seen = seen_tokens(logits.shape[-1], input_ids, prompt_attn)
            logits = repetition_penalty(logits, live.seen, params.repetition_penalty)
        logprobs, tok = next_tokens(logits, params, generator)
        done, rows = live.done, live.rows
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        out.record(t, rows, done, tok, logprobs, raw, params.temperature)
        hit_eos = torch.isin(tok, eos) & ~done
        if live.seen is not None:
            live.seen.scatter_(1, tok[:, None], (~done)[:, None])
        if stop_hits is not None:
            hit_eos |= _stop_string_hits(stop_hits, gen, rows, ~done & ~hit_eos, tok, device)
        out.stop(t, rows[hit_eos])
        done |= hit_eos
        if budget is not None:  # rows at their own budget: finished (length)
            spent = (budget[rows] <= t + 1) & ~done
            out.cut(t, rows[spent])
            done |= spent
        if bool(done.all()):
            break
        live.advance(tok)
    if turn is not None:
        turn.keep(live.cache, live.done.nonzero().squeeze(-1), live.rows, live.attn)
    return out.lists()


class _Live:
    """The rows of a micro-batch still decoding (finished ones are dropped, KV cache
    included): each one's index in the micro-batch, whether it has finished, the attention
    mask so far, the next forward's ids and positions, and the tokens each has seen
    (``seen``, for the repetition penalty; set at the first step)."""

    def __init__(self, ids: torch.Tensor, attn: torch.Tensor, turn, pad_id: int) -> None:
        B, device = ids.shape[0], ids.device
        self.cache, self.turn = DynamicCache(), turn
        self.ids, self.attn = ids, attn
        self.pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        if turn is not None and (begun := turn.start(ids, attn, pad_id)) is not None:
            self.cache, self.ids, self.attn, self.pos = begun
        self.rows = torch.arange(B, device=device)
        self.done = torch.zeros(B, dtype=torch.bool, device=device)
        self.seen: torch.Tensor | None = None  # [b, V] bool

    def forward(self, model, extra: dict) -> torch.Tensor:
        """The next step's logits, [b, V] float32."""
        out = model(input_ids=self.ids, attention_mask=self.attn, position_ids=self.pos,
                    past_key_values=self.cache, use_cache=True, **extra)  # fmt: skip
        return out.logits[:, -1, :].float()

    def advance(self, tok: torch.Tensor) -> None:
        """Feed ``tok`` [b] next; once an eighth of the rows finished, drop them (their KV
        first kept for their next turn)."""
        self.ids, self.pos = tok[:, None], self.pos[:, -1:] + 1
        done = self.done
        if int(done.sum()) * 8 >= len(self.rows):
            keep = (~done).nonzero().squeeze(-1)
            if self.turn is not None:
                self.turn.keep(self.cache, done.nonzero().squeeze(-1), self.rows, self.attn)
            self.cache.batch_select_indices(keep)
            self.rows, self.done, self.attn = self.rows[keep], done[keep], self.attn[keep]
            self.ids, self.pos = self.ids[keep], self.pos[keep]
            self.seen = None if self.seen is None else self.seen[keep]
        self.attn = torch.cat([self.attn, (~self.done).long()[:, None]], dim=1)  # [b, L+t+1]


def stop_strings(tokenizer, stops: tuple[str, ...]) -> Callable[[list[list[int]]], list[bool]]:
    """:func:`stop_string_matcher` on ``tokenizer``'s text with special tokens kept: a stop
    string that is a special token (a tool's call marker such as Llama 3.1's
    ``<|python_tag|>``) stops the sequence too."""
    return stop_string_matcher(lambda ids: tokenizer.decode(ids, skip_special_tokens=False), stops)


def stop_string_matcher(
    decode: Callable[[list[int]], str], stops: tuple[str, ...]
) -> Callable[[list[list[int]]], list[bool]]:
    """For each completion so far, whether its decoded tail contains a stop string.

    Only the last few tokens are decoded (enough for the longest stop string: every
    earlier position was checked at an earlier step)."""
    window = max(len(s) for s in stops) + 4

    def hits(completions: list[list[int]]) -> list[bool]:
        out = []
        for ids in completions:
            text = decode(ids[-window:]) if ids else ""
            out.append(any(s in text for s in stops))
        return out

    return hits


def micro_batches(
    lengths: list[int], max_new_tokens: int, batch_size: int, max_batch_tokens: int | None
) -> Iterator[tuple[int, int]]:
    """``(start, end)`` slices of consecutive jobs: at most ``batch_size`` sequences and, when
    ``max_batch_tokens`` is set, at most that many padded tokens (rows x (longest prompt +
    max_new_tokens)); a job too long for the budget alone still gets a batch of one."""
    start = 0
    while start < len(lengths):
        end, longest = start, 0
        while end < len(lengths) and end - start < batch_size:
            longest_next = max(longest, lengths[end])
            cost = (end - start + 1) * (longest_next + max_new_tokens)
            if max_batch_tokens is not None and end > start and cost > max_batch_tokens:
                break
            longest, end = longest_next, end + 1
        yield start, end
        start = end


DECODE_MODES = ("auto", "dynamic", "static", "cuda_graphs")
_AUTO_FAILED: set[str] = set()


def _decode_loop(model, decode: str, stats: dict | None):
    """The micro-batch loop ``generate`` runs for ``decode`` (see :func:`generate`)."""
    from functools import partial

    from grpo_core.engines import static_decode

    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
    why = static_decode.static_unsupported(model)
    auto = decode == "auto"
    if auto:
        on_cuda = next(model.parameters()).device.type == "cuda"
        decode = "cuda_graphs" if on_cuda and why is None and not _AUTO_FAILED else "dynamic"
    elif decode != "dynamic" and why is not None:
        raise ValueError(f"decode={decode!r} is not possible with this model: {why}")
    if stats is not None:
        stats["decode"] = decode
    if decode == "dynamic":
        return _generate_batch
    static = partial(static_decode.generate_batch_static, graphs=decode == "cuda_graphs")
    if decode == "cuda_graphs" and next(model.parameters()).device.type != "cuda":
        raise ValueError("decode='cuda_graphs' needs the model on a CUDA device")
    if not auto:
        return static

    def static_or_dynamic(*args, **kwargs):
        """``auto``: a static loop that fails falls back to the dynamic one, for good."""
        if _AUTO_FAILED:
            return _generate_batch(*args, **kwargs)
        try:
            return static(*args, **kwargs)
        except Exception as e:
            _AUTO_FAILED.add(f"{type(e).__name__}: {e}"[:300])
            logging.getLogger(__name__).warning(
                "hf engine: static decoding failed (%s); decoding dynamically from now on",
                next(iter(_AUTO_FAILED)),
            )
            if stats is not None:
                stats["decode"] = "dynamic"
            return _generate_batch(*args, **kwargs)

    return static_or_dynamic


def generate(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    *,
    pad_token_id: int,
    eos_token_ids: int | list[int],
    batch_size: int = 512,
    max_batch_tokens: int | None = DEFAULT_MAX_BATCH_TOKENS,
    tokenizer=None,
    desc: str = "generate",
    progress: bool = True,
    decode: str = "auto",
    stats: dict | None = None,
    turns=None,
    episodes: list | None = None,
    budgets: list[int] | None = None,
) -> list[Sample]:
    """Sample ``params.n`` completions for each tokenised prompt.

    Returns samples ordered by prompt then sample index. Completion ids include the EOS
    token when the sequence stopped on it. Stop strings (``params.stop``) need ``tokenizer``.
    ``decode``: ``dynamic`` (this module's loop: finished rows leave the batch; the CPU's
    default), ``static`` (``grpo_core.engines.static_decode``: fixed shapes, a static KV cache, the
    host reads every few steps), ``cuda_graphs`` (static, each decode step replayed from a
    CUDA graph), ``auto`` (``cuda_graphs`` on a CUDA device where the model supports it, else
    ``dynamic``). ``stats`` gets ``decode``: the mode that ran, and ``prefill_tokens``.
    ``turns`` (a :class:`grpo_core.engines.turn_cache.TurnCache`) keeps each sample's KV
    cache for its episode's next turn, ``episodes[i]`` naming job i's episode (job: prompt
    major, then sample); a prompt that continues an episode whose KV it keeps (its ids
    start with the kept ones) is fed only the tokens after them. ``budgets[i]``: job i's own
    most new tokens (at most ``params.max_new_tokens``; the turn loop's episode budgets): a
    sample that reaches it ends there, finish reason ``length``.
    """
    if not prompt_ids:
        return []
    stop_hits = None
    if params.stop:
        if tokenizer is None:
            raise ValueError("stop strings need the tokenizer: generate(..., tokenizer=tok)")
        stop_hits = stop_strings(tokenizer, params.stop)
    eos_ids = {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(params.seed)
    jobs = [(p, s) for p in range(len(prompt_ids)) for s in range(params.n)]
    batch_fn = _decode_loop(model, decode, stats)
    was_training = model.training
    model.eval()
    samples: list[Sample] = []
    try:
        with tqdm(total=len(jobs), desc=desc, unit="seq", disable=not progress, leave=False) as bar:
            lengths = [len(prompt_ids[p]) for p, _ in jobs]
            for start, end in micro_batches(
                lengths, params.max_new_tokens, batch_size, max_batch_tokens
            ):
                chunk = jobs[start:end]
                contexts = [prompt_ids[p] for p, _ in chunk]
                turn = None if turns is None else turns.batch(episodes[start:end], contexts)
                batch = DecodeBatch(contexts, params, pad_token_id, eos_ids, generator,
                                    stop_hits, stats=stats, turn=turn,
                                    budgets=None if budgets is None else budgets[start:end])  # fmt: skip
                ids, lps, reasons, pol = batch_fn(model, batch)
                if turn is not None:
                    turn.done(ids)
                pol = pol if pol is not None else [None] * len(chunk)
                for (p, s), c, lp, r, q in zip(chunk, ids, lps, reasons, pol, strict=True):
                    samples.append(Sample(p, s, c, lp, r, policy_logprobs=q))
                bar.update(len(chunk))
    finally:
        model.train(was_training)
    return samples
