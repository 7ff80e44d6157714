"""The turn loop: the one place above the engines where an episode is sampled, and the one
request every sampling path hands down.

:class:`SampleRequest` says what to sample (the ``SamplingParams``) and with what (the
engine's name and options, how the sampling copy of the policy loads, whether to probe the
weight sync, the progress bar's label). The rollout task builds it once; the executor
(cluster/executor.py), the local engine process (cluster/engine_process.py) and the Ray
rollout replicas (cluster/rollout_workers.py, cluster/replica.py) pass it on unchanged, and
whichever process holds the engine calls :func:`run_turns`.

:func:`run_turns` is where a multi-turn episode would continue: each prompt's ids go to the
engine, and the engine's reply is one model turn. Today every episode is that one turn, so a
``Sample``'s completion is all model tokens: its ``loss_mask`` is None (all 1) and its
``turns`` None (one assistant turn spanning the completion). An environment that answers a
model turn with an observation appends the observation's tokens to the same ids (never
re-tokenising the conversation), marks them 0 in ``loss_mask`` and records the turn
boundaries in ``turns``; the engines, the engine process and the replicas need no change.
Nothing here imports prefect, mlflow or ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_core.generation import Sample, SamplingParams


@dataclass(frozen=True)
class SampleRequest:
    """What to sample and with which engine (picklable: it crosses to the engine process
    and the Ray replicas)."""

    params: SamplingParams
    engine: str = "hf"
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    # how a process that loads its own copy of the policy loads it (the run's model section)
    load_options: Mapping[str, Any] = field(default_factory=dict)
    check_sync: bool = False  # probe that the engine's weights are the trainer's
    desc: str = "rollout"

    @classmethod
    def of(cls, spec: Mapping, params: SamplingParams, *, load_options=None, desc: str):
        """The request for an engine ``spec`` (``{"name", "options", "check_sync"}``, the
        stage's engine setting)."""
        return cls(
            params,
            engine=spec["name"],
            engine_options=dict(spec.get("options") or {}),
            load_options=dict(load_options or {}),
            check_sync=bool(spec.get("check_sync", False)),
            desc=desc,
        )

    def with_params(self, params: SamplingParams, desc: str | None = None) -> SampleRequest:
        return dataclasses.replace(self, params=params, desc=desc or self.desc)


def run_turns(
    engine, prompt_ids: list[list[int]], params: SamplingParams, *, desc: str, progress: bool
) -> list[Sample]:
    """``params.n`` episodes per prompt with ``engine`` (anything with the rollout engines'
    ``generate``), ordered by prompt then sample index. One model turn per episode: every
    completion token is the model's (``Sample.loss_mask`` None)."""
    return engine.generate(prompt_ids, params, desc=desc, progress=progress)
