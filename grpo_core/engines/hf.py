"""The ``hf`` engine: :func:`grpo_core.engines.generation.generate` on a Hugging Face model.

It samples with the module it is given. Passed the trainer's own model (the warm policy),
the weights are always current and :meth:`HFEngine.update_weights` has nothing to copy.
With ``turn_cache`` (the default) the turn loop of a multi-turn episode keeps each
episode's KV cache from one turn to the next (grpo_core/engines/turn_cache.py); ``fed``
counts the tokens its prefill forwards were fed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from grpo_core.config.stages import DEFAULT_MAX_BATCH_TOKENS
from grpo_core.engines.generation import Sample, SamplingParams, generate
from grpo_core.engines.turn_cache import TurnCache


class HFEngine:
    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        batch_size: int = 512,
        max_batch_tokens: int | None = DEFAULT_MAX_BATCH_TOKENS,
        decode: str = "auto",
        turn_cache: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.decode = decode  # grpo_core.engines.generation.generate's decode loop
        self.last_decode: str | None = None  # the loop the last generate() ran
        self.keeps_turns = turn_cache  # keep an episode's KV across its turns
        # tokens fed to the prefill forwards since the engine started (padding: positions)
        self.fed = {"prefill_tokens": 0, "prefill_positions": 0}

    @classmethod
    def create(
        cls,
        *,
        checkpoint: str | Path | None = None,
        model: torch.nn.Module | None = None,
        tokenizer=None,
        dtype: str | torch.dtype = "float32",
        **opts,
    ) -> HFEngine:
        if model is None or tokenizer is None:
            if checkpoint is None:
                raise ValueError("hf engine: give model and tokenizer, or a checkpoint")
            from grpo_core.training.checkpoint import load_checkpoint

            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
            model, tokenizer = load_checkpoint(checkpoint, dtype=dtype)
        return cls(model, tokenizer, **opts)

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        *,
        desc: str = "generate",
        progress: bool = True,
        turns: TurnCache | None = None,
        episodes: list | None = None,
        budgets: list[int] | None = None,
    ) -> list[Sample]:
        """``turns``, ``episodes``: the turn loop's kept KV (:meth:`turn_cache`) and each
        sample's episode; ``budgets``: each sample's own most new tokens
        (grpo_core.engines.generation.generate)."""
        tok = self.tokenizer
        stats: dict = {}
        samples = generate(
            self.model,
            prompt_ids,
            params,
            pad_token_id=tok.pad_token_id,
            eos_token_ids=tok.eos_token_id,
            batch_size=self.batch_size,
            max_batch_tokens=self.max_batch_tokens,
            tokenizer=tok,
            desc=desc,
            progress=progress,
            decode=self.decode,
            stats=stats,
            turns=turns,
            episodes=episodes,
            budgets=budgets,
        )
        self.last_decode = stats.get("decode")
        for k in self.fed:
            self.fed[k] += stats.get(k, 0)
        return samples

    def turn_cache(self) -> TurnCache | None:
        """A turn loop's store of its episodes' KV (None: the option is off, each turn
        feeds the whole context)."""
        return TurnCache() if self.keeps_turns else None

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state_dict`` into the model, unless it is the model's own tensors."""
        own = self.model.state_dict()
        if all(k in own and v.data_ptr() == own[k].data_ptr() for k, v in state_dict.items()):
            return
        self.model.load_state_dict(dict(state_dict), strict=True)

    def sleep(self) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    def close(self) -> None:
        self.model = None
