"""The process's cluster setting, its executor and its Ray connection, kept in
cluster/process.py (``STATE``).

``configure`` is called once per config by ``process.set_up`` (the run context,
flows/run_context.py); tasks hand their work to ``executor()`` (cluster/executor.py), the
local or the Ray one for that setting. ``ensure_ray`` connects to (or starts) Ray on first
use; Ray is imported only there."""

from __future__ import annotations

import atexit
import logging

from cluster.config import ClusterConfig
from cluster.executor import Local, for_config
from cluster.process import STATE

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


def ensure_ray(cfg: ClusterConfig | None = None):
    """The ``ray`` module, connected: to ``cfg.address`` when given, else to a local Ray
    started here (stopped when this process exits)."""
    import ray

    cfg = cfg or STATE.cluster
    if ray.is_initialized():
        return ray
    if cfg.address:
        log.info("connecting to the Ray cluster at %s", cfg.address)
        ray.init(address=cfg.address, log_to_driver=True)
    else:
        from cluster.resources import local_num_cpus

        ray.init(num_cpus=local_num_cpus(cfg), include_dashboard=False, log_to_driver=True)
        atexit.register(shutdown)
        log.info("started a local Ray (%s CPUs)", ray.cluster_resources().get("CPU"))
    return ray


def shutdown() -> None:
    """Disconnect; a local Ray started by ``ensure_ray`` stops with it."""
    import sys

    replicas = sys.modules.get("cluster.rollout_workers")
    if replicas is not None:  # the rollout replicas of this process end with the connection
        replicas.close_all()
    trainers = sys.modules.get("cluster.trainer_group")
    if trainers is not None:  # and so does its trainer group
        trainers.release()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
