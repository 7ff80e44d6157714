"""What the ``hf`` engine's decode loops record of each sampled token: the token, its
log-probability under the distribution it was sampled from (the sampling policy's logprob,
vLLM's ``processed_logprobs``: a rollout file's ``completion_logprobs``) and, when that
distribution was processed (:func:`processes_distribution`: top-p, top-k, min-p, a
repetition penalty), also under the policy's own temperature-scaled softmax, before any of
that (:func:`policy_logprobs`; ``Sample.policy_logprobs``, a rollout file's
``completion_policy_logprobs``): the quantity the trainer recomputes, which a behaviour
weight must divide by to compare like with like (grpo_core/algorithm/importance.py).

:class:`Completions` holds a micro-batch's records on the device while it is sampled: the
dynamic loop (grpo_core/engines/generation.py) records the rows still in its batch, the
static one (grpo_core/engines/static_decode.py) every row, finished ones as padding.
"""

from __future__ import annotations

import torch

from grpo_core.config.settings import SamplingParams


def processes_distribution(params: SamplingParams) -> bool:
    """Whether sampling with ``params`` draws from another distribution than the policy's
    temperature-scaled softmax (greedy decoding samples nothing)."""
    return params.temperature > 0 and (
        params.top_p < 1.0
        or params.top_k > 0
        or params.min_p > 0.0
        or params.repetition_penalty != 1.0
    )


def policy_logprobs(logits: torch.Tensor, tok: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sampled tokens' log-probs under ``log_softmax(logits / temperature)``, the
    model's logits before any processing (the trainer's recompute).  logits: [b, V], tok:
    [b]; returns [b]"""
    return (logits / temperature).log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)


class Completions:
    """A micro-batch's completions as they are sampled, on the device: tokens and logprobs
    [B, max_new_tokens] (and the policy's own logprobs, ``policy``, when the sampling
    distribution is processed), and each sequence's length and whether it stopped (else:
    length)."""

    def __init__(
        self, B: int, max_new_tokens: int, pad_id: int, device: torch.device, policy: bool = False
    ):
        self.tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.logp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
        self.policy = torch.zeros_like(self.logp) if policy else None
        self.lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
        self.stopped = torch.zeros(B, dtype=torch.bool, device=device)

    def record(self, t: int, rows, done, tok, logprobs, raw, temperature: float) -> None:
        """Step ``t``'s token and its logprob (and, when recording them, its policy logprob
        from the step's unprocessed logits ``raw`` [b, V]) for the rows not done yet.
        rows, done, tok: [b] (``rows``: their index in the micro-batch); logprobs: [b, V]"""
        live = rows[~done]
        self.tokens[live, t] = tok[~done]
        self.logp[live, t] = logprobs.gather(-1, tok[:, None]).squeeze(-1)[~done]
        if self.policy is not None:
            self.policy[live, t] = policy_logprobs(raw, tok, temperature)[~done]

    def record_all(self, t: int, done, tok, logprobs, raw, temperature: float) -> None:
        """Step ``t`` for every row, as :meth:`record`; a finished row's (its token is
        padding) logprobs are 0.  done, tok: [B]; logprobs, raw: [B, V]"""
        self.tokens[:, t] = tok
        self.logp[:, t] = logprobs.gather(-1, tok[:, None]).squeeze(-1).masked_fill(done, 0.0)
        if self.policy is not None:
            pol = policy_logprobs(raw, tok, temperature)  # [B]
            self.policy[:, t] = pol.masked_fill(done, 0.0)

    def stop(self, t: int, rows) -> None:
        """These rows stopped at step ``t`` (their token of that step is kept)."""
        self.lengths[rows] = t + 1
        self.stopped[rows] = True

    def cut(self, t: int, rows) -> None:
        """These rows reached their own token budget at step ``t`` (finish: length)."""
        self.lengths[rows] = t + 1

    def lists(self) -> tuple[list[list[int]], list[list[float]], list[str], list | None]:
        """Per row: tokens, logprobs, finish reason; and the policy logprobs (or None)."""
        completions, logps, reasons, policy = [], [], [], []
        for i in range(len(self.lengths)):
            n = int(self.lengths[i])
            completions.append(self.tokens[i, :n].tolist())
            logps.append(self.logp[i, :n].tolist())
            reasons.append("stop" if bool(self.stopped[i]) else "length")
            if self.policy is not None:
                policy.append(self.policy[i, :n].tolist())
        return completions, logps, reasons, policy if self.policy is not None else None
