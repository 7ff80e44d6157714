"""The rows of a scored Parquet that an RL update trains on: the columns the update reads,
the groups it keeps (with dynamic sampling, DAPO: those with reward variance;
``grpo_core/algorithm/sampling_filters.py``) and their padded :class:`~grpo_core.contracts.batch.UpdateBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import torch

from grpo_core.algorithm.batch import build_batch, check_advantages
from grpo_core.algorithm.sampling_filters import dynamic_sampling_mask
from grpo_core.contracts.batch import UpdateBatch
from grpo_core.contracts.rollouts import POLICY_LOGPROBS, group_ids, read_scored

COLUMNS = ["prompt_ids", "completion_ids", "completion_logprobs", "advantage", "finish_reason"]


@dataclass
class ScoredRows:
    """A scored file as the update reads it."""

    path: str
    table: pa.Table  # the whole file: its metadata and policy ids say where old log-probs come from
    columns: dict[str, list]  # COLUMNS, every row
    group_ids: list[int]  # every row's group
    keep: list[int]  # the rows trained on
    metrics: dict[str, float]  # ``dynamic_sampling/kept_frac`` with dynamic sampling

    @classmethod
    def read(cls, path: str, *, dynamic_sampling: bool = False) -> ScoredRows:
        """``path``'s rows; with ``dynamic_sampling`` only the groups with some non-zero
        advantage are kept (a group without reward variance carries no signal)."""
        return cls._of(read_scored(path), path, dynamic_sampling)

    @classmethod
    def _of(cls, table: pa.Table, path, dynamic_sampling: bool) -> ScoredRows:
        names = COLUMNS + [POLICY_LOGPROBS] * (POLICY_LOGPROBS in table.column_names)
        columns = table.select(names).to_pydict()
        _check_finite(columns["advantage"], path)
        gids = group_ids(table, path)
        keep = list(range(table.num_rows))
        metrics: dict[str, float] = {}
        if dynamic_sampling:
            informative = dynamic_sampling_mask(
                torch.tensor(columns["advantage"], dtype=torch.float64, device="cpu"),
                torch.tensor(gids, device="cpu"),
            )
            keep = informative.nonzero().squeeze(-1).tolist()
            metrics["dynamic_sampling/kept_frac"] = len(keep) / max(1, table.num_rows)
        return cls(str(path), table, columns, gids, keep, metrics)

    @classmethod
    def of_table(cls, table: pa.Table, *, dynamic_sampling: bool = False) -> ScoredRows:
        """A scored table in memory (``grpo_core.algorithm.iteration.score``) as :meth:`read` gives a
        file's rows."""
        return cls._of(table, "scored table", dynamic_sampling)

    def batch(self, pad_id: int, *, mask_truncated: bool, sampling_logprobs: bool) -> UpdateBatch:
        """The kept rows padded: truncated rows (``finish_reason`` length) with an empty mask
        when ``mask_truncated``; the sampler's log-probs when ``sampling_logprobs`` (the
        engine correction, the behaviour weight or ``old_logprobs="sampler"`` reads them):
        :meth:`behaviour_logprobs`."""
        pick = lambda name: [self.columns[name][i] for i in self.keep]  # noqa: E731
        truncated = [r == "length" for r in pick("finish_reason")] if mask_truncated else None
        return build_batch(
            pick("prompt_ids"),
            pick("completion_ids"),
            pick("advantage"),
            pad_id,
            truncated=truncated,
            group_ids=[self.group_ids[i] for i in self.keep],
            sampling_logprobs=self.behaviour_logprobs() if sampling_logprobs else None,
            loss_masks=self._loss_masks(),
        )

    def behaviour_logprobs(self) -> list[list[float]]:
        """The kept rows' sampler log-probs in the trainer's terms, the policy's own softmax
        at the sampling temperature: ``completion_policy_logprobs`` where the file has them
        (the sampler processed its distribution: top-p, top-k, ...), else
        ``completion_logprobs``. A ratio against the trainer's log-probs then compares like
        with like: 1 on a row the updated policy sampled, whatever its filter."""
        own, sampled = self.columns.get(POLICY_LOGPROBS), self.columns["completion_logprobs"]
        if own is None:
            return [sampled[i] for i in self.keep]
        return [sampled[i] if own[i] is None else own[i] for i in self.keep]

    def _loss_masks(self) -> list[list[int] | None] | None:
        """The kept rows' ``loss_mask`` (multi-turn rollouts: 0 on tokens an environment
        added), or None when the file has none (every completion token the model's)."""
        if "loss_mask" not in self.table.column_names:
            return None
        masks = self.table.column("loss_mask").to_pylist()
        return [masks[i] for i in self.keep]


def _check_finite(advantages: list, path) -> None:
    """A scored file's advantages, checked before the update (:func:`check_advantages`,
    the hint: re-score it)."""
    check_advantages(advantages, str(path), hint="the scoring stage writes 0 for rows it "
                     "could not score; re-score the file with grpo score")  # fmt: skip
