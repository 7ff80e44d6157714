"""Prefect run names that say which pipeline and stage a run belongs to (``demo/rl_1``,
``demo/rl_1/rollout-0``)."""

from __future__ import annotations


def named(call, name: str):
    """``call`` (a Prefect task or flow) whose run is named ``name``."""
    if hasattr(call, "flow_run_name"):
        return call.with_options(flow_run_name=lambda: name)
    return call.with_options(task_run_name=lambda: name)
