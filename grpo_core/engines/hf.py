"""The ``hf`` engine: :func:`grpo_core.engines.generation.generate` on a Hugging Face model.

It samples with the module it is given. Passed the trainer's own model (the warm policy),
the weights are always current and :meth:`HFEngine.update_weights` has nothing to copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from grpo_core.config.stages import DEFAULT_MAX_BATCH_TOKENS
from grpo_core.engines.generation import Sample, SamplingParams, generate


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
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.decode = decode  # grpo_core.engines.generation.generate's decode loop
        self.last_decode: str | None = None  # the loop the last generate() ran

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
    ) -> list[Sample]:
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
        )
        self.last_decode = stats.get("decode")
        return samples

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
