"""The rollout engine in its own process (cluster/engine_process.py, ``rl.async_level``): a
snapshot sampled there gives this process's samples for those weights, a snapshot is frozen
when taken, a failing request comes back as an error and the process serves the next one,
and a killed process is started again."""

from __future__ import annotations

import os

import pytest
import torch

from cluster.engine_process import EngineProcessError
from cluster.executor import Local
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import SampleRequest
from grpo_core.training.checkpoint import load_checkpoint


def _policy(path, pid: str):
    from types import SimpleNamespace

    model, tokenizer = load_checkpoint(path)
    return SimpleNamespace(checkpoint=path, policy_id=pid, model=model, tokenizer=tokenizer)


def _sample(executor: Local, policy, prompts, seed: int = 3):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=seed)
    return executor.sample(policy, prompts, SampleRequest(params, desc="test"))


def _ids(samples):
    return [(s.completion_ids, [round(x, 4) for x in s.logprobs]) for s in samples]


@pytest.fixture
def one_thread():
    """The child samples with 1 thread (cluster.rollout.num_cpus): so does this process, so
    the two compute the same floats."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_snapshot_samples_in_the_child_as_here(tiny_checkpoint, one_thread):
    executor = Local()
    try:
        here = _policy(tiny_checkpoint, "p0")
        prompts = [here.tokenizer.encode("12+34=")] * 2
        expected = _sample(executor, here, prompts)
        executor.hold("p0", lambda: here, tiny_checkpoint)
        snap = executor.held_policy("p0")
        assert snap.model is None and snap.policy_id == "p0"
        with torch.no_grad():  # the trainer goes on: the snapshot keeps the weights it took
            for p in here.model.parameters():
                p.add_(0.5)
        got = _sample(executor, snap, prompts)
        assert _ids(got) == _ids(expected)
        child = executor._engine_process._proc.pid
        assert child != os.getpid()
        start, end = executor.served_here()
        assert start <= end
        assert snap.dtype == "float32"

        # the changed weights, held as another policy, reach the child and sample otherwise
        executor.hold("p1", lambda: here, tiny_checkpoint)
        moved = _sample(executor, executor.held_policy("p1"), prompts)
        assert _ids(moved) == _ids(_sample(executor, here, prompts))
        assert _ids(moved) != _ids(expected)
        executor.release("p0")
        assert executor.held_policy("p0") is None
    finally:
        executor.close()


def test_a_failed_request_is_an_error_and_a_dead_child_is_replaced(tiny_checkpoint):
    executor = Local()
    try:
        here = _policy(tiny_checkpoint, "p0")
        executor.hold("p0", lambda: here, tiny_checkpoint)
        snap = executor.held_policy("p0")
        vocab = here.model.config.vocab_size
        with pytest.raises(EngineProcessError, match="test in the engine process"):
            _sample(executor, snap, [[vocab + 5]])  # a token id past the embedding
        proc = executor._engine_process._proc
        assert proc.is_alive()  # and it answers the next request
        assert len(_sample(executor, snap, [here.tokenizer.encode("1+1=")])) == 2

        proc.kill()  # between requests: the next one starts a new child
        proc.join()
        assert len(_sample(executor, snap, [here.tokenizer.encode("1+1=")])) == 2
        assert executor._engine_process._proc.pid != proc.pid
    finally:
        executor.close()
    assert executor._engine_process is None


def test_a_lora_policy_samples_in_the_child_with_its_adapter(tiny_checkpoint, one_thread):
    """A LoRA policy's snapshot carries the adapter merged in: the child samples the policy
    the rollout file records, not the base (issue 41, the hf-engine case)."""
    pytest.importorskip("peft")
    from types import SimpleNamespace

    from grpo_core.config.stages import LoraConfig
    from grpo_core.training.lora import attach_adapter

    executor = Local()
    try:
        model, tokenizer = load_checkpoint(tiny_checkpoint)
        peft_model = attach_adapter(model, LoraConfig(r=4, alpha=8))
        with torch.no_grad():  # a trained adapter: B != 0, so the policy is not the base
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        here = SimpleNamespace(checkpoint=tiny_checkpoint, policy_id="lora", model=peft_model,
                               tokenizer=tokenizer)  # fmt: skip
        prompts = [tokenizer.encode("12+34=")] * 2
        expected = _sample(executor, here, prompts)
        base = _sample(executor, _policy(tiny_checkpoint, "base"), prompts)
        assert _ids(expected) != _ids(base)  # the adapter changes what is sampled
        executor.hold("lora", lambda: here, tiny_checkpoint)
        got = _sample(executor, executor.held_policy("lora"), prompts)
        assert _ids(got) == _ids(expected)
    finally:
        executor.close()


PARENT = """
import sys, threading, time
sys.path.insert(0, {root!r})
from cluster.executor import Local


def main():
    from grpo_core.training.checkpoint import load_checkpoint
    from grpo_core.engines.generation import SamplingParams
    from grpo_core.engines.turns import SampleRequest
    from types import SimpleNamespace

    model, tok = load_checkpoint({ckpt!r})
    here = SimpleNamespace(checkpoint={ckpt!r}, policy_id="p", model=model, tokenizer=tok)
    ex = Local()
    ex.hold("p", lambda: here, {ckpt!r})
    snap = ex.held_policy("p")
    params = SamplingParams(n=64, temperature=1.0, max_new_tokens=200, seed=0)  # a long request
    request = SampleRequest(params, desc="long")
    threading.Thread(target=lambda: ex.sample(snap, [tok.encode("1+1=")] * 512, request),
                     daemon=True).start()
    while getattr(getattr(getattr(ex, "_engine_process", None), "_proc", None), "pid", None) is None:
        time.sleep(0.1)
    print(ex._engine_process._proc.pid, flush=True)
    time.sleep(600)


if __name__ == "__main__":  # the engine process is spawned: it imports this file
    main()
"""


def test_the_engine_process_ends_when_grpo_is_killed_mid_request(tiny_checkpoint, tmp_path):
    """Issue 44: a SIGKILLed parent left the engine process sampling; it now ends within a
    few seconds, in the middle of a request."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(root=root, ckpt=str(tiny_checkpoint)))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        child = int(parent.stdout.readline())
        time.sleep(12)  # the child has started sampling the long request (minutes of work)
        assert os.path.exists(f"/proc/{child}")
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 15
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(child), "the engine process outlived its parent"
    finally:
        parent.kill()


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for init to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
