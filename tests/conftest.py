"""Shared fixtures: offline environment, a tiny real model saved to disk, Prefect harness."""

from __future__ import annotations

from flows.env import apply_defaults

# before any test module imports Prefect or MLflow; tests log through plain Python logging
apply_defaults(flow_logs=False)

import signal  # noqa: E402

import pytest  # noqa: E402

# A shell starts a background job (`pytest ... &`, `nohup`, .ci/run's parallel stream) with
# SIGINT ignored, and every process a test starts would inherit that: Ctrl-C tests would see
# their signal vanish. Default handling here gives the children the default again on exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The README's test command (`pytest -m "not full"`) runs the unit, core, engine, tool and
# reward tests and one whole recipe end to end, in minutes on 2 cores; `.ci/run` then runs the
# rest (`-m full`): every other slow end-to-end run (kill and resume, async, replay, the tool
# demo, SmolLM2), the code sandbox's hostile programs and reaping, the Ray cluster and the
# distributed trainers, and the real Prefect / MLflow servers and browser.
FULL_ONLY = (
    "tests/cluster/",
    "tests/distributed/",
    "tests/infra/",
    "tests/rewards/test_sandbox.py",
    "tests/rewards/test_harness.py",
    "tests/tools/test_sandbox_reaping.py",
    "tests/tools/test_tool_sandbox.py",
    "tests/tools/test_tool_sandbox_warm.py",
    "tests/tools/test_tool_preflight.py",
    "tests/pipeline/test_fail_fast.py",
    "tests/pipeline/test_lost_signals.py",
)
QUICK_END_TO_END = (
    "tests/pipeline/test_flow_smoke.py::test_whole_pipeline_runs_and_tracks_every_stage"
)


@pytest.hookimpl(tryfirst=True)  # before -m selects on it
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid == QUICK_END_TO_END:
            continue
        if item.get_closest_marker("slow") or item.nodeid.startswith(FULL_ONLY):
            item.add_marker(pytest.mark.full)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A randomly initialised 2-layer Qwen2 + char tokenizer, ``save_pretrained`` to disk."""
    from grpo_core.demo.model import save_base_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    return save_base_model(
        path,
        seed=0,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )


@pytest.fixture
def tiny_llama():
    """A builder of randomly initialised 2-layer Llamas, 16 wide (seed 0): ``build(tie=False,
    vocab_size=64, **config)``."""

    def build(tie: bool = False, vocab_size: int = 64, **extra):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                          tie_word_embeddings=tie, **extra)  # fmt: skip
        return LlamaForCausalLM(cfg)

    return build


@pytest.fixture
def tiny_model(tiny_checkpoint):
    from grpo_core.training.checkpoint import load_checkpoint

    return load_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="session")
def prefect_harness():
    """A real Prefect engine and API (temporary local server) for flow tests."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def tracking_uri(tmp_path):
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _keep_tracking_env():
    """``mlflow.set_tracking_uri`` in a test writes MLFLOW_TRACKING_URI; later tests (and the
    processes they start) would send their runs there instead of their own default."""
    import os

    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before
