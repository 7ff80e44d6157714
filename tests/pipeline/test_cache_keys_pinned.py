"""The stage cache keys of the rollout, score and update tasks, pinned: a refactor that
changes what a key hashes (a setting added, dropped or renamed in the key, the order of the
inputs) fails here. The code version, which every key also hashes, is held constant."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from grpo_core.config.stages import RLConfig
from tasks import cache
from tasks.rollout import HF_ENGINE, rollout_key
from tasks.score import score_key
from tasks.update import update_key

RL = {
    "default": {},
    "demo": yaml.safe_load(Path("configs/demo.yaml").read_text())["rl"],
    "knobs": {
        "beta": 0.04,
        "loss_type": "grpo",
        "async_level": 1,
        "iterations": 7,
        "eval_every": 3,
    },
    "sampling": {
        "temperature": 0.7,
        "top_p": 0.9,
        "max_completion_length": 64,
        "scale_rewards": "batch",
        "num_generations": 4,
    },
}
# computed before the second pass over the house (b957bc0)
PINNED = {
    "default": ("62f1fa69d6bed05e7fb9f591", "a6e3bd8dd6f4ff559f6e818f", "f18bd0f1541f78fbb1c93f15"),
    "demo": ("62f1fa69d6bed05e7fb9f591", "a6e3bd8dd6f4ff559f6e818f", "3d3ce3e5c7f1897d73f67685"),
    "knobs": ("62f1fa69d6bed05e7fb9f591", "a6e3bd8dd6f4ff559f6e818f", "911fbc3f1bdb73aaf0889e7d"),
    "sampling": (
        "c860a68e9aa4a020dedb0a56",
        "1ed077ad3b3760605c88d25b",
        "d1601dd6b48d8e683b21f03f",
    ),
}


@pytest.mark.parametrize("name", sorted(RL))
def test_stage_keys_are_pinned(name, tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "code_version", lambda: "pinned")
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"policy weights stand-in")
    b.write_bytes(b"prompts stand-in")
    rl = RLConfig(**RL[name])
    weights = {"accuracy": 1.0, "format": 0.1}
    keys = (
        rollout_key("rl_1", 3, str(a), str(b), rl, 0, HF_ENGINE),
        score_key(weights, rl, str(a)),
        update_key(rl, str(a), str(b), str(a), global_step=4, total_steps=100, seed=0),
    )
    assert keys == PINNED[name]


def test_editing_a_user_environment_or_reward_changes_the_keys(tmp_path, monkeypatch):
    """A ``file.py:function`` environment or reward is code the stage runs: editing its file
    invalidates the rollouts and scores it made (built-in names keep the pinned keys)."""
    monkeypatch.setattr(cache, "code_version", lambda: "pinned")
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"policy weights stand-in")
    b.write_bytes(b"prompts stand-in")
    user = tmp_path / "mine.py"
    user.write_text("def make_env(spec):\n    return None\n\ndef reward(**kw):\n    return []\n")
    rl = RLConfig()
    engine = HF_ENGINE.with_tools({"tools": [f"{user}:make_env"]})

    def keys():
        return (rollout_key("rl_1", 3, str(a), str(b), rl, 0, engine),
                score_key({f"{user}:reward": 1.0}, rl, str(a)))  # fmt: skip

    before = keys()
    assert keys() == before
    user.write_text(user.read_text() + "# edited\n")
    after = keys()
    assert after[0] != before[0] and after[1] != before[1]
    python = HF_ENGINE.with_tools({"tools": ["python"]})
    assert cache.user_code(["python", "accuracy"]) == {}
    assert rollout_key("rl_1", 3, str(a), str(b), rl, 0, python) != before[0]
