"""A local Ray head for the cluster tests: 127.0.0.1, 2 CPUs, once per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_head():
    """``ray`` connected to a head started here; the rollout replicas and Ray stop after the
    module's tests."""
    ray = pytest.importorskip("ray")
    from cluster import runtime

    if ray.is_initialized():
        runtime.shutdown()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        runtime.shutdown()
        runtime.configure(runtime.ClusterConfig())
