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

import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from grpo_core.config.settings import SamplingParams  # noqa: F401  (imported from here too)
from grpo_core.config.stages import DEFAULT_MAX_BATCH_TOKENS
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


def _repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on seen tokens: positive logits / penalty, negative * penalty.
    logits: [B, V] float, seen: [B, V] bool"""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # [B, V]
    return torch.where(seen, penalised, logits)


def _filter_logits(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Mask logits outside min-p / top-k / nucleus top-p with -inf.  logits: [B, V]"""
    if min_p > 0.0:
        probs = logits.softmax(-1)  # [B, V]
        keep = probs >= min_p * probs.amax(-1, keepdim=True)  # [B, V]
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)  # [B, V]
        cum = sorted_logits.softmax(-1).cumsum(-1)  # [B, V]
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the token that crosses top_p
        drop = drop.scatter(-1, idx, drop)  # back to vocab order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _forward_takes(model, name: str) -> bool:
    """Whether the model's forward takes the keyword ``name`` (a peft wrapper passes it on
    to the model it wraps)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return name in inspect.signature(inner.forward).parameters


def _keeps_last_logits(model) -> bool:
    """Whether the model's forward takes transformers' ``logits_to_keep``."""
    return _forward_takes(model, "logits_to_keep")


def _left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded to the longest: input ids and attention mask, [B, L] each."""
    L = max(len(p) for p in prompts)
    ids = [[pad_id] * (L - len(p)) + list(p) for p in prompts]
    attn = [[0] * (L - len(p)) + [1] * len(p) for p in prompts]
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(attn, dtype=torch.long, device=device),
    )


def _next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: the argmax (temperature 0) or a sample of the temperature-scaled,
    filtered distribution. Returns (logprobs [b, V] of that distribution, tokens [b])."""
    if params.temperature == 0:
        return logits.log_softmax(-1), logits.argmax(-1)
    scaled = _filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
    logprobs = scaled.log_softmax(-1)  # [b, V]
    return logprobs, torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)


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
    model: PreTrainedModel,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int,
    eos_ids: set[int],
    generator: torch.Generator | None,
    stop_hits: Callable[[list[list[int]]], list[bool]] | None = None,
    *,
    stats: dict | None = None,
    turn=None,
    budgets: list[int] | None = None,
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """One micro-batch. ``turn`` (grpo_core/engines/turn_cache.py): the episodes' KV kept
    from their earlier turns (only the tokens after it are fed) and kept again for the next.
    ``budgets``: each row's own most new tokens (a row that reaches it finishes, length)."""
    device = model.device
    B = len(prompts)
    input_ids, attn = _left_pad(prompts, pad_id, device)
    prompt_attn = attn  # the whole contexts' tokens (repetition penalty)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, L]
    cache = DynamicCache()
    step_ids, step_pos = input_ids, position_ids
    if turn is not None and (begun := turn.start(input_ids, attn, pad_id)) is not None:
        cache, step_ids, attn, step_pos = begun
    count_prefill(stats, attn[:, -step_ids.shape[1] :])
    eos = torch.tensor(sorted(eos_ids), device=device)
    processed = processes_distribution(params)
    out = Completions(B, params.max_new_tokens, pad_id, device, policy=processed)
    gen: list[list[int]] = [[] for _ in range(B)]  # completions so far (stop strings)
    # the rows still in the batch (finished ones are dropped, KV cache included): their
    # index in the micro-batch, whether each has finished, and the tokens each has seen
    rows = torch.arange(B, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    seen = None  # [b, V] bool: tokens in prompt or completion (repetition penalty)
    budget = None if budgets is None else torch.tensor(budgets, device=device)  # [B]

    last_only = {"logits_to_keep": 1} if _keeps_last_logits(model) else {}
    for t in range(params.max_new_tokens):
        logits = (
            model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
                **last_only,  # the prompt's forward: the head on its last position only
            )
            .logits[:, -1, :]
            .float()
        )  # [b, V]
        raw = logits
        if params.repetition_penalty != 1.0:
            if seen is None:  # the first step: attn is the prompts' mask
                counts = torch.zeros(logits.shape, dtype=torch.long, device=device)  # [B, V]
                seen = counts.scatter_add_(1, input_ids, prompt_attn) > 0  # no padding
            logits = _repetition_penalty(logits, seen, params.repetition_penalty)
        logprobs, tok = _next_tokens(logits, params, generator)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        out.record(t, rows, done, tok, logprobs, raw, params.temperature)
        hit_eos = torch.isin(tok, eos) & ~done
        if seen is not None:
            seen.scatter_(1, tok[:, None], (~done)[:, None])
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
        step_ids = tok[:, None]
        step_pos = step_pos[:, -1:] + 1
        if int(done.sum()) * 8 >= len(rows):  # an eighth finished: drop them from the batch
            keep = (~done).nonzero().squeeze(-1)
            if turn is not None:  # their KV first, for their next turn
                turn.keep(cache, done.nonzero().squeeze(-1), rows, attn)
            cache.batch_select_indices(keep)
            rows, done, attn = rows[keep], done[keep], attn[keep]
            step_ids, step_pos = step_ids[keep], step_pos[keep]
            seen = None if seen is None else seen[keep]
        attn = torch.cat([attn, (~done).long()[:, None]], dim=1)  # [b, L+t+1]
    if turn is not None:
        turn.keep(cache, done.nonzero().squeeze(-1), rows, attn)
    return out.lists()


def count_prefill(stats: dict | None, fed: torch.Tensor) -> None:
    """Add a prefill forward's tokens to ``stats``: ``prefill_tokens`` (real ones) and
    ``prefill_positions`` (padding included).  fed: [b, q] attention mask of the fed tokens"""
    if stats is not None:
        stats["prefill_tokens"] = stats.get("prefill_tokens", 0) + int(fed.sum())
        stats["prefill_positions"] = stats.get("prefill_positions", 0) + fed.numel()


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
                ids, lps, reasons, pol = batch_fn(
                    model,
                    contexts,
                    params,
                    pad_token_id,
                    eos_ids,
                    generator,
                    stop_hits,
                    stats=stats,
                    **({} if turn is None else {"turn": turn}),
                    **({} if budgets is None else {"budgets": budgets[start:end]}),
                )
                if turn is not None:
                    turn.done(ids)
                pol = pol if pol is not None else [None] * len(chunk)
                for (p, s), c, lp, r, q in zip(chunk, ids, lps, reasons, pol, strict=True):
                    samples.append(Sample(p, s, c, lp, r, policy_logprobs=q))
                bar.update(len(chunk))
    finally:
        model.train(was_training)
    return samples
