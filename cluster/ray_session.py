"""This process's Ray connection: :func:`ensure_ray` connects to (or starts) Ray on first use,
:func:`shutdown` ends it with the replicas and trainer group of this process. Ray is imported
only here and in the functions that use the connection."""

from __future__ import annotations

import atexit
import logging

from cluster.config import ClusterConfig
from cluster.state import STATE

log = logging.getLogger(__name__)


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

        # address="local": a Ray of this run's own even when one already runs on this
        # machine (`ray start --head`, a test's cluster): ray.init would join that one, and
        # then refuse the num_cpus given here
        ray.init(address="local", num_cpus=local_num_cpus(cfg), include_dashboard=False,
                 log_to_driver=True)  # fmt: skip
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
