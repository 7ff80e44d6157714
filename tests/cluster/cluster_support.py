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


def _ddp_cases():
    """tests/distributed/ddp_cases.py: the scored file the data-parallel tests train on."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "distributed" / "ddp_cases.py"
    spec = importlib.util.spec_from_file_location("_ddp_cases", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def scored_file(directory, groups: int = 3) -> str:
    """``groups`` groups x 4 completions with rewards varying within each group, scored by
    the score task in this process (the module's Ray setting is for the update)."""
    from cluster import runtime
    from cluster.config import ClusterConfig

    cfg = runtime.current()
    runtime.configure(ClusterConfig())
    try:
        return _ddp_cases().scored_file(directory, groups)
    finally:
        runtime.configure(cfg)
