"""rollout.vllm.offload_optimizer (grpo_core/training/offload.py): AdamW's moments leave the GPU while a
colocated engine generates and come back, to their own devices, before the next step. The
CUDA tests run on a GPU machine (benchmarks/gpu_bench.sh runs tests/gpu); on a CPU the state
already lives in CPU memory and both moves are no-ops, which is checked here too."""

from __future__ import annotations

import pytest
import torch

from grpo_core.training import offload

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _stepped(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024, device=device)).sum().backward()
    opt.step()
    return model, opt


def test_cpu_state_stays_where_it_is():
    model, opt = _stepped("cpu")
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    assert offload.offload(opt) == 0 and not offload.is_offloaded(opt)
    assert offload.restore(opt) == 0
    for k, v in opt.state[model.weight].items():
        assert torch.equal(v, before[k])


@cuda
def test_moments_leave_the_gpu_and_come_back_for_the_next_step():
    model, opt = _stepped("cuda")
    twin, twin_opt = _stepped("cuda")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved = offload.offload(opt)
    assert moved == 2 * 4 * sum(p.numel() for p in model.parameters())  # exp_avg, exp_avg_sq
    assert torch.cuda.memory_allocated() <= held - moved
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    assert offload.restore(opt) == moved
    step = opt.state[model.weight]["step"]
    assert step.device == twin_opt.state[twin.weight]["step"].device  # AdamW's counter: as it was
    assert opt.state[model.weight]["exp_avg"].device.type == "cuda"
    for m, o in ((model, opt), (twin, twin_opt)):  # one more step each: the same weights
        m(torch.ones(4, 1024, device="cuda")).sum().backward()
        o.step()
    assert torch.equal(model.weight, twin.weight)
