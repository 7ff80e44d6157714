"""Shared fixtures: offline environment, a tiny real model saved to disk, Prefect harness."""

from __future__ import annotations

from flows.env import apply_defaults

# before any test module imports Prefect or MLflow; tests log through plain Python logging
apply_defaults(flow_logs=False)

import pytest  # noqa: E402


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
