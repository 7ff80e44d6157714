"""The process's cluster setting, its executor and its Ray connection.

``configure`` is called once per process by the run context (flows/run_context.py); tasks
hand their work to ``executor()`` (cluster/executor.py), the local or the Ray one for that
setting. ``ensure_ray`` connects to (or starts) Ray on first use; Ray is imported only
there."""

from __future__ import annotations

import atexit
import logging

from cluster.config import ClusterConfig
from cluster.executor import Local, for_config

_current = ClusterConfig()
_executor: Local | None = None
_started_here = False

log = logging.getLogger(__name__)


def configure(cfg: ClusterConfig) -> None:
    global _current, _executor
    if _executor is not None and cfg != _current:
        _executor.close()  # its engines were started for the other setting
        _executor = None
    _current = cfg


def current() -> ClusterConfig:
    return _current


def executor() -> Local:
    """Where this process's rollouts, scoring and updates run, for the current setting."""
    global _executor
    if _executor is None:
        _executor = for_config(_current)
    return _executor


def ensure_ray(cfg: ClusterConfig | None = None):
    """The ``ray`` module, connected: to ``cfg.address`` when given, else to a local Ray
    started here (stopped when this process exits)."""
    global _started_here
    import ray

    cfg = cfg or _current
    if ray.is_initialized():
        return ray
    if cfg.address:
        log.info("connecting to the Ray cluster at %s", cfg.address)
        ray.init(address=cfg.address, log_to_driver=True)
    else:
        from cluster.resources import local_num_cpus

        ray.init(num_cpus=local_num_cpus(cfg), include_dashboard=False, log_to_driver=True)
        _started_here = True
        atexit.register(shutdown)
        log.info("started a local Ray (%s CPUs)", ray.cluster_resources().get("CPU"))
    return ray


def shutdown() -> None:
    """Disconnect; a local Ray started by ``ensure_ray`` stops with it."""
    global _started_here
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
    _started_here = False
