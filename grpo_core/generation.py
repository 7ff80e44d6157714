"""The ``hf`` rollout engine: batched sampling with a KV cache and left padding.

All prompts x ``n`` samples go through the model in micro-batches of ``batch_size``
sequences. Each step feeds only the newest token (the KV cache holds the rest), samples
from the temperature / top-k / top-p adjusted distribution, and records the log-probability
of the sampled token under that same distribution (the sampling policy's logprob). Only a
[batch, vocab] slice of logits exists at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 48
    seed: int | None = None


@dataclass
class Sample:
    """One completion of one prompt."""

    prompt_index: int
    sample_index: int
    completion_ids: list[int]
    logprobs: list[float]  # sampling policy's logprob of each completion token
    finish_reason: str  # "stop" (EOS) or "length"


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k / nucleus top-p with -inf.  logits: [B, V]"""
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


@torch.no_grad()
def _generate_batch(
    model: PreTrainedModel,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int,
    eos_ids: set[int],
    generator: torch.Generator | None,
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    device = model.device
    B = len(prompts)
    L = max(len(p) for p in prompts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        input_ids[i, L - len(p) :] = torch.tensor(p)
        attn[i, L - len(p) :] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, L]
    cache = DynamicCache()
    eos = torch.tensor(sorted(eos_ids), device=device)

    out_tokens = torch.full((B, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_logp = torch.zeros((B, params.max_new_tokens), dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.full((B,), params.max_new_tokens, dtype=torch.long, device=device)
    stopped = torch.zeros(B, dtype=torch.bool, device=device)

    step_ids, step_pos = input_ids, position_ids
    for t in range(params.max_new_tokens):
        logits = (
            model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
            )
            .logits[:, -1, :]
            .float()
        )  # [B, V]
        if params.temperature == 0:
            logprobs = logits.log_softmax(-1)  # [B, V]
            tok = logits.argmax(-1)  # [B]
        else:
            scaled = _filter_logits(logits / params.temperature, params.top_k, params.top_p)
            logprobs = scaled.log_softmax(-1)  # [B, V]
            tok = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)  # [B]
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        out_tokens[:, t] = tok
        out_logp[:, t] = logprobs.gather(-1, tok[:, None]).squeeze(-1).masked_fill(done, 0.0)
        hit_eos = torch.isin(tok, eos) & ~done
        lengths = torch.where(hit_eos, torch.full_like(lengths, t + 1), lengths)
        stopped |= hit_eos
        done |= hit_eos
        if bool(done.all()):
            break
        attn = torch.cat([attn, (~done).long()[:, None]], dim=1)  # [B, L+t+1]
        step_ids = tok[:, None]
        step_pos = step_pos[:, -1:] + 1

    completions, logps, reasons = [], [], []
    for i in range(B):
        n = int(lengths[i])
        completions.append(out_tokens[i, :n].tolist())
        logps.append(out_logp[i, :n].tolist())
        reasons.append("stop" if bool(stopped[i]) else "length")
    return completions, logps, reasons


def generate(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    *,
    pad_token_id: int,
    eos_token_ids: int | list[int],
    batch_size: int = 512,
    desc: str = "generate",
    progress: bool = True,
) -> list[Sample]:
    """Sample ``params.n`` completions for each tokenised prompt.

    Returns samples ordered by prompt then sample index. Completion ids include the EOS
    token when the sequence stopped on it.
    """
    if not prompt_ids:
        return []
    eos_ids = {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(params.seed)
    jobs = [(p, s) for p in range(len(prompt_ids)) for s in range(params.n)]
    was_training = model.training
    model.eval()
    samples: list[Sample] = []
    try:
        with tqdm(total=len(jobs), desc=desc, unit="seq", disable=not progress, leave=False) as bar:
            for start in range(0, len(jobs), batch_size):
                chunk = jobs[start : start + batch_size]
                ids, lps, reasons = _generate_batch(
                    model,
                    [prompt_ids[p] for p, _ in chunk],
                    params,
                    pad_token_id,
                    eos_ids,
                    generator,
                )
                for (p, s), c, lp, r in zip(chunk, ids, lps, reasons, strict=True):
                    samples.append(Sample(p, s, c, lp, r))
                bar.update(len(chunk))
    finally:
        model.train(was_training)
    return samples
