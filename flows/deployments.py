"""Deployments: the R1 pipeline and the stage flows as Prefect deployments the UI can run.

Two ways to register them, both against the server in ``PREFECT_API_URL``:

- ``grpo serve`` (or ``python -m flows.serve_cli``): this process registers every deployment and runs their flow runs itself
  (``prefect.serve``); no work pool needed. Ctrl-C stops it (its deployments are paused).
- ``prefect deploy --prefect-file infra/prefect.yaml --all`` + ``infra/start-servers.sh
  worker``: the same deployments, run by a process worker polling the ``grpo-local`` pool.

Deployments point at :func:`r1_from_config` (config path + ``--set``-style overrides,
both editable in the UI's "Run" form) rather than at ``r1_pipeline(cfg)``, whose pydantic
argument would show up in the UI as one big JSON form. Both are the Prefect flow
``r1-pipeline``: one flow page, one history of runs, whether started by `grpo run` or a
deployment. Each deployment carries an example
cron schedule that is created inactive: switch it on in the UI when you want it.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

from prefect import flow

from flows.config import DEFAULT_CRON, load_config
from flows.env import apply_defaults

R1_FLOW = "r1-pipeline"  # the pipeline's Prefect flow, whichever way it is started
R1_DEPLOYMENT = "r1-pipeline"
TAGS = ["grpo"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageFlow:
    """A stage flow that gets its own deployment (``module:function``, looked up lazily)."""

    deployment: str
    entrypoint: str
    description: str


# Stage flows for standalone reruns from files (the `grpo score/update/eval/rollout` commands).
# A stage whose flow cannot be imported is skipped with a warning, so this table can name flows
# before they land.
STAGE_FLOWS = (
    StageFlow("score", "flows.stages:score_flow", "Re-score stored rollouts with a reward mix"),
    StageFlow("update", "flows.stages:update_flow", "Offline GRPO update from a scored Parquet"),
    StageFlow("eval", "flows.stages:eval_flow", "Held-out evaluation of a checkpoint"),
    StageFlow("rollout", "flows.stages:rollout_flow", "Sample rollouts from a checkpoint"),
)


def _config_run_name() -> str:
    """The flow run's name: the ``run_name`` its config and overrides give (as `grpo run`)."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    try:
        return load_config(
            params.get("config") or None, list(params.get("overrides") or [])
        ).run_name
    except Exception:  # a bad config fails in the flow itself, with its message
        return "r1-pipeline"


def _end_tracking(flow, flow_run, state) -> None:
    from flows.r1 import _end_tracking as end  # MLflow is imported only in the flow run

    end(flow, flow_run, state)


# The same Prefect flow as `grpo run` (flows/r1.py: its name and hooks), so runs from the
# CLI and from the deployments share one history.
@flow(
    name=R1_FLOW,
    flow_run_name=_config_run_name,
    log_prints=True,
    on_failure=[_end_tracking],
    on_crashed=[_end_tracking],
    on_cancellation=[_end_tracking],
)
def r1_from_config(config: str | None = None, overrides: list[str] | None = None) -> dict:
    """Run the whole R1 pipeline from a YAML preset.

    Args:
        config: path to a YAML preset on the machine that runs the flow (the worker's or
            `grpo serve`'s); empty: the packaged demo preset.
        overrides: `section.key=value` strings, as `grpo run --set`, applied in order,
            e.g. `["rl.iterations=10", "tracking.uri=http://127.0.0.1:5000"]`.
    """
    apply_defaults()  # a deployment's flow run starts in a bare worker process
    from flows.r1 import locked_pipeline  # imports MLflow, which reads the defaults at import

    cfg = load_config(config or None, list(overrides or []))
    return locked_pipeline(cfg)


def _load_stage_flows() -> list[tuple[StageFlow, object]]:
    found, missing = [], []
    for spec in STAGE_FLOWS:
        module, _, attr = spec.entrypoint.partition(":")
        try:
            found.append((spec, getattr(importlib.import_module(module), attr)))
        except (ImportError, AttributeError):
            missing.append(spec.entrypoint)
    if missing:
        log.warning("stage deployments skipped, flows not importable: %s", ", ".join(missing))
    return found


def build_deployments(
    cron: str | None = DEFAULT_CRON,
    stages: bool = True,
    config: str | None = None,
    overrides: list[str] | None = None,
) -> list:
    """RunnerDeployments for `prefect.serve`: the pipeline, then each importable stage flow.

    ``config``/``overrides`` become the pipeline deployment's default parameters (still
    editable per run in the UI). ``cron`` is attached as an inactive schedule.
    """
    from prefect.schedules import Cron
    from prefect.types.entrypoint import EntrypointType

    def schedules() -> list:
        return [Cron(cron, active=False)] if cron else []

    # The deployment's entrypoint is this module's path, which the flow-run process imports.
    deployments = [
        r1_from_config.to_deployment(
            name=R1_DEPLOYMENT,
            description="The whole R1 recipe: cold-start SFT -> RL -> rejection sampling "
            "-> re-SFT -> RL -> evaluation. Parameters: a YAML preset and --set overrides.",
            parameters={"config": config, "overrides": list(overrides or [])},
            schedules=schedules(),
            tags=TAGS,
            entrypoint_type=EntrypointType.MODULE_PATH,
        )
    ]
    if stages:
        for spec, stage_flow in _load_stage_flows():
            deployments.append(
                stage_flow.to_deployment(
                    name=spec.deployment,
                    description=spec.description,
                    schedules=schedules(),
                    tags=[*TAGS, "stage"],
                    entrypoint_type=EntrypointType.MODULE_PATH,
                )
            )
    return deployments


def serve_all(
    cron: str | None = DEFAULT_CRON,
    limit: int | None = 1,
    stages: bool = True,
    config: str | None = None,
    overrides: list[str] | None = None,
) -> None:
    """Register the deployments and run their flow runs in this process until interrupted.

    ``limit`` bounds concurrent flow runs (1: one training job at a time on this machine).
    """
    from prefect import serve

    apply_defaults()
    serve(*build_deployments(cron, stages, config, overrides), limit=limit)
