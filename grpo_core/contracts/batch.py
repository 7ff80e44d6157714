"""The padded tensors of one generation batch, and how they split: micro-batches of whole groups
(the optimizer's unit, TRL's meaning) and, inside one, physical chunks bounded by a token budget
(the memory's unit: ``rl.max_tokens_per_microbatch``). Built by
``grpo_core.algorithm.batch.build_batch``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class UpdateBatch:
    """Padded tensors of one generation batch. N sequences, prompt width P, completion T."""

    input_ids: Tensor  # [N, P + T] left-padded prompt, right-padded completion
    attention_mask: Tensor  # [N, P + T]
    completion_ids: Tensor  # [N, T]
    completion_mask: Tensor  # [N, T] 1 on real completion tokens
    advantages: Tensor  # [N]
    prompt_width: int  # P
    group_ids: Tensor | None = None  # [N] rows of one prompt's group share an id
    sampling_logp: Tensor | None = None  # [N, T] rollout engine's log-probs (0 on padding)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str) -> UpdateBatch:
        """Every tensor on ``device``: the one place where an update's inputs cross to the
        model's device (``grpo_core.algorithm.update.grpo_update``); indices and everything derived
        from the batch are then made there too."""
        device = torch.device(device)
        if self.device == device and all(
            t is None or t.device == device for t in (self.group_ids, self.sampling_logp)
        ):
            return self

        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return UpdateBatch(
            move(self.input_ids),
            move(self.attention_mask),
            move(self.completion_ids),
            move(self.completion_mask),
            move(self.advantages),
            self.prompt_width,
            move(self.group_ids),
            move(self.sampling_logp),
        )

    def slice(self, idx: Tensor) -> UpdateBatch:
        return UpdateBatch(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.completion_ids[idx],
            self.completion_mask[idx],
            self.advantages[idx],
            self.prompt_width,
            None if self.group_ids is None else self.group_ids[idx],
            None if self.sampling_logp is None else self.sampling_logp[idx],
        )

    def step_slices(self, steps: int) -> list[Tensor]:
        """Row indices of ``steps`` micro-batches holding whole groups (as equal as possible)."""
        gids = self.group_ids
        if gids is None:
            gids = torch.arange(self.size, device=self.device)
        groups = torch.unique_consecutive(gids)  # [G] rows must be group-contiguous
        if len(groups) != len(torch.unique(gids)):
            raise ValueError(
                "the rows of a group must be contiguous (the rollout stage writes them so): "
                "a group split over two optimizer steps would train its rows twice"
            )
        if len(groups) < steps:
            raise ValueError(f"batch of {len(groups)} groups does not split into {steps} steps")
        if self.group_ids is None and self.size % steps:
            raise ValueError(f"batch of {self.size} rows does not split into {steps} steps")
        parts = torch.tensor_split(groups, steps)
        return [torch.isin(gids, part).nonzero().squeeze(-1) for part in parts]

    def trimmed(self) -> UpdateBatch:
        """The same rows without the columns that are padding in every row (prompt columns on
        the left, completion columns on the right). Positions are counted from each row's
        first token, so the model computes the same thing on fewer columns."""
        P = self.prompt_width
        attn = self.attention_mask.bool()  # [n, P + T]
        prompt_used = attn[:, :P].any(0).nonzero()
        start = int(prompt_used[0]) if len(prompt_used) else P
        comp_used = attn[:, P:].any(0).nonzero()
        t = int(comp_used[-1]) + 1 if len(comp_used) else 1
        return UpdateBatch(
            self.input_ids[:, start : P + t],
            self.attention_mask[:, start : P + t],
            self.completion_ids[:, :t],
            self.completion_mask[:, :t],
            self.advantages,
            P - start,
            self.group_ids,
            None if self.sampling_logp is None else self.sampling_logp[:, :t],
        )

    def token_chunks(self, max_tokens: int | None) -> list[Tensor]:
        """Consecutive row ranges whose trimmed, padded size (rows x (longest prompt + longest
        completion among them)) is at most ``max_tokens``; a row longer than the budget on its
        own is a chunk by itself. ``None``: one chunk of every row."""
        if max_tokens is None or self.size == 0:
            return [torch.arange(self.size, device=self.device)]
        P = self.prompt_width
        attn = self.attention_mask
        prompt_len = attn[:, :P].sum(-1).tolist()
        comp_len = attn[:, P:].sum(-1).tolist()
        chunks, start, p_max, c_max = [], 0, 0, 0
        for i in range(self.size):
            p, c = max(p_max, prompt_len[i]), max(c_max, comp_len[i])
            if i > start and (i - start + 1) * (p + max(c, 1)) > max_tokens:
                chunks.append(torch.arange(start, i, device=self.device))
                start, p, c = i, prompt_len[i], comp_len[i]
            p_max, c_max = p, c
        chunks.append(torch.arange(start, self.size, device=self.device))
        return chunks
