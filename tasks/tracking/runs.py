"""Where every MLflow run of a pipeline starts and ends: a block per run.

:func:`stage_run` (a stage's run, or any run nested in the pipeline's parent) and
:func:`parent_run` (the pipeline's) start the run when the block starts and end it when the
block ends: FINISHED when the block completes; when an exception leaves it, the run and the
runs opened inside it that are still open (an RL stage's iteration runs) end FAILED for an
error and KILLED for a signal (Ctrl-C, SIGTERM), the innermost first. These are the statuses
the flow's hooks and ``grpo``'s top level give the runs left open (tasks/tracking/run_states.py:
``end_open_runs``), which stay as the net for a run started outside such a block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.tracking.run_states import end_runs_from, ended_status
from tasks.tracking.stages import Tracking


@contextmanager
def stage_run(
    tracking: Tracking, stage: str, tags: dict[str, str] | None = None, *, config=None
) -> Iterator[str]:
    """The block of ``stage``'s run under the pipeline's parent run (``Tracking.start_child``:
    its name, tags and ``config_hash``); yields its run id."""
    run_id = tracking.start_child(stage, tags, config=config)
    with _ended(tracking, run_id):
        yield run_id


@contextmanager
def parent_run(
    tracking: Tracking,
    run_name: str,
    tags: dict[str, str],
    *,
    params: dict | None = None,
    workspace: str | Path | None = None,
    system_metrics: tuple[str, ...] = (),
) -> Iterator[Tracking]:
    """The block of the pipeline's parent run (``Tracking.start_parent``: a new run, or the
    continued one of a killed pipeline); yields the ``Tracking`` of that parent."""
    parent = tracking.start_parent(
        run_name, tags, params=params, workspace=workspace, system_metrics=system_metrics
    )
    with _ended(parent, parent.parent_run_id):
        yield parent


@contextmanager
def _ended(tracking: Tracking, run_id: str) -> Iterator[None]:
    try:
        yield
    except BaseException as exc:
        end_runs_from(run_id, ended_status(exc))
        raise
    tracking.end(run_id)
