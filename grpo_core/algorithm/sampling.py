"""Step 1 of a GRPO iteration (grpo_core/algorithm/iteration.py): sample. Each row's prompt,
``n`` times, through the turn loop (grpo_core/engines/turns.py: ``run_turns``), on an engine
here or where the pipeline's executor samples; :func:`sample` makes the rollout table
(grpo_core/contracts/rollouts.py), :func:`sample_episodes` gives the samples before they are
a table (the held-out evaluation samples through it too: grpo_core/algorithm/evaluation.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

    from grpo_core.engines.generation import Sample


def sample(
    engine,
    tokenizer,
    rows: list[dict],
    request,
    *,
    policy_id: str,
    iteration: int = 0,
    desc: str = "rollout",
    progress: bool = True,
    tools=None,
    run=None,
    context: int | None = None,
    metadata: dict | None = None,
) -> pa.Table:
    """``n`` completions of each row's ``prompt`` through the turn loop, as a table of the
    rollout contract (grpo_core/contracts/rollouts.py).

    ``request``: a ``SampleRequest`` (grpo_core/engines/turns.py: params, engine options,
    environment), or just its ``SamplingParams``; ``tools`` (a ``ToolSpec`` or its fields,
    ``RolloutConfig.tool_spec()``) adds an environment to it. With an environment, each
    episode starts from its row, as the pipeline's rollouts sample them. ``run(prompt_ids,
    request)`` samples where the pipeline's executor does (its engine process or the Ray
    replicas: tasks/rollout.py); by default ``engine`` runs it here. ``context``: the
    model's positions (prompts that cannot fit ``max_new_tokens`` more are refused, by
    row; an episode whose environment's reset() extends its prompt past them is an error on
    that episode: grpo_core/engines/openings.py); ``metadata``: the rollout file's. The
    samples themselves: :func:`sample_episodes`."""
    from grpo_core.contracts.rollouts import rollout_table

    prompt_ids, samples = sample_episodes(engine, tokenizer, rows, request, desc=desc,
                                          progress=progress, tools=tools, run=run,
                                          context=context)  # fmt: skip
    return rollout_table(rows, prompt_ids, samples, tokenizer, policy_id=policy_id,
                         iteration=iteration, metadata=metadata)  # fmt: skip


def sample_episodes(
    engine,
    tokenizer,
    rows: list[dict],
    request,
    *,
    desc: str = "rollout",
    progress: bool = True,
    tools=None,
    run=None,
    context: int | None = None,
    field: str = "max_completion_length",
) -> tuple[list[list[int]], list[Sample]]:
    """Each row's prompt ids and its ``n`` samples (prompt-major: row i's are
    ``samples[i*n : (i+1)*n]``), the arguments as :func:`sample`'s; ``field``: the setting
    a prompt-length error names. The one sampling call: the rollouts (:func:`sample`) and
    the held-out evaluation (grpo_core/algorithm/evaluation.py) both sample through it."""
    from grpo_core.contracts.text import row_prompt_ids
    from grpo_core.engines.context import check_prompt_lengths
    from grpo_core.engines.turns import SampleRequest

    if not isinstance(request, SampleRequest):
        request = SampleRequest(request, desc=desc)
    if tools is not None:
        request = dataclasses.replace(request, tools=tools)
    if request.tools is not None:  # the environment starts each episode from its data row
        request = dataclasses.replace(request, rows=tuple(rows), context=context)
    prompt_ids = [row_prompt_ids(tokenizer, r) for r in rows]
    check_prompt_lengths(prompt_ids, context=context, max_new_tokens=request.params.max_new_tokens,
                         field=field, source=request.desc)  # fmt: skip
    if run is not None:
        return prompt_ids, run(prompt_ids, request)
    return prompt_ids, request.run(engine, prompt_ids, progress=progress)
