"""Shared settings of the cluster tests."""

from __future__ import annotations


def ray_cluster(rollout_workers: int = 2, scoring_workers: int = 2):
    """A ``cluster:`` section that fits the tests' 2-CPU head: replicas and scoring tasks take
    half a CPU each."""
    from cluster.config import ClusterConfig

    return ClusterConfig(
        backend="ray",
        rollout={"workers": rollout_workers, "num_cpus": 0.5},
        scoring={"workers": scoring_workers, "num_cpus": 0.5},
    )
