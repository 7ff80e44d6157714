"""infra/ray/: the `ray up` cluster, the KubeRay manifest, the Dockerfile and the Prefect
deployment parse and agree with each other and with the code (no cluster is started here)."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import yaml

from flows.config import load_config

REPO = Path(__file__).parents[2]
RAY = REPO / "infra" / "ray"
EXTRAS = "[ray,gpu,vllm]"


def _ray_pin() -> str:
    """The Ray version of pyproject's ``ray`` extra (``ray==2.60.*`` -> ``2.60``)."""
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'"ray==(\d+\.\d+)\.\*"', text).group(1)


def test_ray_up_cluster_has_a_head_and_gpu_workers_installing_the_package():
    cfg = yaml.safe_load((RAY / "cluster.yaml").read_text())
    nodes = cfg["available_node_types"]
    assert cfg["head_node_type"] in nodes
    gpu = [n for n in nodes.values() if n["resources"].get("GPU", 0) >= 1]
    assert gpu and all(n["max_workers"] <= cfg["max_workers"] for n in gpu)
    assert "." in cfg["file_mounts"].values()  # the checkout
    assert any(EXTRAS in c and "pip install" in c for c in cfg["setup_commands"])
    assert any("--head" in c for c in cfg["head_start_ray_commands"])
    assert any("$RAY_HEAD_IP" in c for c in cfg["worker_start_ray_commands"])
    assert any("/mnt/grpo" in c for c in cfg["initialization_commands"])


def test_kuberay_manifest_mounts_one_shared_volume_and_asks_for_gpus():
    docs = list(yaml.safe_load_all((RAY / "kuberay.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"PersistentVolumeClaim", "RayCluster"}
    pvc, rc = kinds["PersistentVolumeClaim"], kinds["RayCluster"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["spec"]["rayVersion"].startswith(_ray_pin() + ".")
    pods = [rc["spec"]["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]
    ]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        (claim,) = [v["persistentVolumeClaim"]["claimName"] for v in volumes.values() if
                    "persistentVolumeClaim" in v]  # fmt: skip
        assert claim == pvc["metadata"]["name"]
        mounts = {m["mountPath"]: m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
        assert set(mounts) == {"/mnt/grpo", "/dev/shm"}
        # Ray's object store in memory, not the container's 64 MiB default
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    gpus = [
        c["resources"]["limits"].get("nvidia.com/gpu")
        for g in rc["spec"]["workerGroupSpecs"]
        for c in g["template"]["spec"]["containers"]
    ]
    assert gpus == ["1"]
    dockerfile = (RAY / "Dockerfile").read_text()
    assert f"rayproject/ray:{rc['spec']['rayVersion']}-" in dockerfile and EXTRAS in dockerfile


def test_prefect_deployment_runs_the_gpu_preset_on_the_ray_cluster():
    spec = yaml.safe_load((RAY / "prefect.yaml").read_text())
    (dep,) = spec["deployments"]
    assert dep["work_pool"]["name"] == "grpo-ray"
    module, _, fn = dep["entrypoint"].rpartition(".")
    assert callable(getattr(importlib.import_module(module), fn))
    params = dep["parameters"]
    assert params["config"] == "configs/gpu.yaml"
    cfg = load_config(REPO / params["config"], params["overrides"])  # the overrides validate
    assert cfg.cluster.backend == "ray" and cfg.cluster.address == "auto"
    assert cfg.rollout.engine == "vllm" and cfg.cluster.rollout.num_gpus == 1
    script = (RAY / "head-worker.sh").read_text()
    assert "grpo-ray" in script and "infra/ray/prefect.yaml" in script
    assert subprocess.run(["bash", "-n", str(RAY / "head-worker.sh")]).returncode == 0
