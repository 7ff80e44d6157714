"""The process's cluster setting, its executor and its Ray connection, kept in
cluster/process.py (``STATE``).

``configure`` is called once per config by ``process.set_up`` (the run context,
flows/run_context.py); tasks hand their work to ``executor()`` (cluster/executor.py), the
local or the Ray one for that setting. The Ray connection (``ensure_ray``, ``shutdown``) is
cluster/ray_session.py's, re-exported here."""

from __future__ import annotations

import logging

from cluster.config import ClusterConfig
from cluster.executor import Local, for_config
from cluster.ray_session import ensure_ray, shutdown
from cluster.state import STATE

__all__ = ["configure", "current", "ensure_ray", "executor", "shutdown"]

log = logging.getLogger(__name__)


def configure(cfg: ClusterConfig) -> None:
    if STATE.executor is not None and cfg != STATE.cluster:
        STATE.executor.close()  # its engines were started for the other setting
        STATE.executor = None
    STATE.cluster = cfg


def current() -> ClusterConfig:
    return STATE.cluster


def executor() -> Local:
    """Where this process's rollouts, scoring and updates run, for the current setting."""
    if STATE.executor is None:
        STATE.executor = for_config(STATE.cluster)
    return STATE.executor
