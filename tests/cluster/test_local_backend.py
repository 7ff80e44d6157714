"""With the default ``cluster.backend: local`` nothing of Ray is imported: a rollout and its
scoring run in the process, as before the cluster layer existed."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from tasks.rollout import sample_rollouts
from tasks.score import score_file
ckpt, out = sys.argv[1], sys.argv[2]
rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}]
sample_rollouts(ckpt, rows, out + "/r.parquet", num_generations=2, temperature=1.0,
                max_completion_length=4, iteration=0, seed=0)
score_file(out + "/r.parquet", out + "/s.parquet", {"accuracy": 1.0})
assert "ray" not in sys.modules, "ray was imported"
print("ok")
"""


def test_the_local_backend_never_imports_ray(tiny_checkpoint, tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_checkpoint), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("ok")


def test_adapter_sync_engines_get_the_runs_lora_rank():
    from cluster.executor import with_lora_rank
    from grpo_core.config.stages import ModelConfig

    lora = ModelConfig(lora={"r": 16, "alpha": 32})
    assert with_lora_rank({"lora_sync": "adapter"}, lora)["lora_rank"] == 16
    assert "lora_rank" not in with_lora_rank({"lora_sync": "merged"}, lora)
    assert "lora_rank" not in with_lora_rank({"lora_sync": "adapter"}, ModelConfig())
    assert with_lora_rank(None, lora) == {}
