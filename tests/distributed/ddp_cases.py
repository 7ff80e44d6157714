"""Updates that the data-parallel parity test runs on one process and on N (module-level, so
that spawned processes can import them by name)."""

from __future__ import annotations

import torch

from grpo_core.algorithm.update import build_batch, grpo_update
from grpo_core.config.loss import EngineCorrection, LossConfig, UpdateConfig
from grpo_core.training.checkpoint import load_checkpoint

PROMPT = [3, 12, 13, 4]
COMPLETIONS = [
    [5, 12, 6, 7, 13, 8, 2],
    [5, 13, 6, 7, 12, 8, 2],
    [5, 12, 12, 6, 2],
    [5, 6, 7, 8, 2],
    [5, 12, 6, 2],
    [5, 13, 6, 7, 12, 8, 12, 6, 2],
    [5, 6, 2],
    [5, 7, 8, 12, 13, 2],
    [5, 8, 8, 2],
    [5, 12, 13, 12, 13, 6, 7, 2],
    [5, 7, 2],
    [5, 6, 12, 13, 8, 2],
]
ADV = [1.0, -1.0, 0.5, -0.5, 1.2, -1.2, 0.3, -0.3, 0.8, -0.8, 0.1, -0.1]


def batch(groups: int, pad_id: int, adv: list[float] | None = None):
    """``groups`` groups of 2 completions of one prompt (the prompt's left padding varies),
    with made-up rollout-engine log-probs."""
    adv = ADV if adv is None else adv
    n = 2 * groups
    prompts = [PROMPT[i % 2 :] for i in range(n)]
    gids = [i // 2 for i in range(n)]
    engine = [
        [-1.5 - 0.1 * ((i + k) % 4) for k in range(len(c))] for i, c in enumerate(COMPLETIONS)
    ]
    return build_batch(
        prompts, COMPLETIONS[:n], adv[:n], pad_id, group_ids=gids, sampling_logprobs=engine[:n]
    )


def cases() -> dict[str, dict]:
    """name -> (number of groups, UpdateConfig keywords, LossConfig keywords)."""
    out = {}
    for lt in ("grpo", "bnpo", "dapo", "dr_grpo"):
        # 6 groups in 4 micro-batches: [2, 2, 1, 1] groups, so rank 1 has none in the last two
        out[lt] = dict(
            groups=6,
            update=dict(steps_per_generation=4, gradient_accumulation_steps=2),
            loss=dict(loss_type=lt, max_completion_length=9),
        )
        out[f"{lt}-beta-budget-mu2"] = dict(
            groups=6,
            update=dict(steps_per_generation=2, num_iterations=2, max_tokens_per_microbatch=24),
            loss=dict(loss_type=lt, max_completion_length=9, beta=0.1),
        )
    out["engine-correction"] = dict(
        groups=6,
        update=dict(
            steps_per_generation=4,
            gradient_accumulation_steps=2,
            engine_correction=EngineCorrection(mode="token_truncate", clip_max=3.0),
        ),
        loss=dict(loss_type="dapo"),
    )
    # groups without reward variance (advantage 0) are skipped (grpo_core.algorithm.update): micro-batches
    # [g0 g1][g2 g3][g4][g5]; rank 1 skips all its rows of the first optimizer step, and with
    # "all-zero-step" every rank skips every row of the second (AdamW still steps)
    zero = [0.0] * 12
    out["zero-advantage"] = dict(
        groups=6,
        update=dict(steps_per_generation=4, gradient_accumulation_steps=2),
        loss=dict(loss_type="bnpo"),
        adv=ADV[:2] + zero[:6] + ADV[8:10] + zero[:2],
    )
    out["zero-advantage-all-zero-step-adamw"] = dict(
        groups=6,
        update=dict(steps_per_generation=4, gradient_accumulation_steps=2),
        loss=dict(loss_type="dapo"),
        adv=ADV[:2] + zero[:10],
        adamw=True,
    )
    # 5 groups in one micro-batch: 3 on rank 0, 2 on rank 1
    out["uneven"] = dict(groups=5, update=dict(), loss=dict(loss_type="bnpo"))
    out["uneven-adamw"] = dict(groups=5, update=dict(), loss=dict(loss_type="dapo"), adamw=True)
    return out


MODES = ("plain", "gpu-defaults")


def run_case(
    name: str,
    checkpoint: str,
    data_parallel=None,
    mode: str = "plain",
    skipped_entropy: bool | None = None,
) -> tuple[dict, list[dict]]:
    """One update from the checkpoint: the new weights and the metrics history. ``mode``
    ``gpu-defaults``: gradient checkpointing on and the optimizers' multi-tensor path forced
    on (CUDA's default), through the project's parameter groups (grpo_core/training/optim.py)."""
    from grpo_core.training.optim import build_optimizer, param_groups

    case = cases()[name]
    model, tok = load_checkpoint(checkpoint)
    ref = load_checkpoint(checkpoint)[0] if case["loss"].get("beta", 0) > 0 else None
    gpu = mode == "gpu-defaults"
    if gpu:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if data_parallel is not None and data_parallel.sharded:
        data_parallel.wrap(model)  # FSDP2, before the optimizer sees the parameters
    if case.get("adamw"):
        opt = build_optimizer(model, "adamw_torch_foreach" if gpu else "adamw_torch", lr=1e-3)
    else:
        opt = torch.optim.SGD(param_groups(list(model.parameters())), lr=0.5, foreach=gpu)
    # replicas measure the entropy of every row, as one process (TRL's headline entropy);
    # sharded ranks that of the rows that ran only (grpo_core/training/parallel.py: ranks_prepare)
    if skipped_entropy is None:
        skipped_entropy = not (data_parallel is not None and data_parallel.sharded)
    update = {"entropy_of_skipped_rows": skipped_entropy, **case["update"]}
    cfg = UpdateConfig(loss=LossConfig(**case["loss"]), **update)
    history = grpo_update(
        model,
        opt,
        None,
        batch(case["groups"], tok.pad_token_id, case.get("adv")),
        cfg,
        ref_model=ref,
        data_parallel=data_parallel,
    )
    if data_parallel is not None and data_parallel.sharded:
        return data_parallel.full_state_dict(model, all_ranks=True), history
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, history


def run_all(
    data_parallel, checkpoint: str, names: list[str], out_dir: str, modes=("plain",)
) -> None:
    """Every case in every mode on this rank; each rank saves what it ended with."""
    results = {
        (name, mode): run_case(name, checkpoint, data_parallel, mode)
        for mode in modes
        for name in names
    }
    torch.save(results, f"{out_dir}/rank{data_parallel.rank}.pt")


def spawn_all(fn, world: int, checkpoint: str, out_dir, modes=("plain",)) -> list[dict]:
    """Every case on ``world`` spawned ranks (``fn``: :func:`run_all` or
    :func:`run_all_sharded`); each rank's ``{(name, mode): (weights, history)}``, in rank
    order."""
    from grpo_core.training.distributed import spawn

    spawn(fn, world, checkpoint, list(cases()), str(out_dir), tuple(modes))
    return [torch.load(f"{out_dir}/rank{r}.pt") for r in range(world)]


def run_all_sharded(
    data_parallel, checkpoint: str, names: list[str], out_dir: str, modes=("plain",)
) -> None:
    """:func:`run_all` with the decoder layers sharded (FSDP2, grpo_core/training/fsdp.py)."""
    from grpo_core.training.fsdp import ShardedDataParallel

    run_all(ShardedDataParallel(data_parallel.group), checkpoint, names, out_dir, modes)


def column_reward(prompts, completions, r, **_):
    return list(r)


def scored_file(directory, groups: int = 3) -> str:
    """A scored Parquet of ``groups`` groups x 4 completions, rewards varying within groups,
    written by the score task from a rollouts file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.score import score_file

    rows = []
    for g in range(groups):
        for s in range(4):
            n = 3 + (s + g) % 3
            rows.append(
                {
                    "prompt_id": f"p{g}",
                    "group_idx": g,
                    "sample_idx": s,
                    "prompt": f"{g}+{g}=",
                    "prompt_text": f"{g}+{g}=",
                    "completion": "x" * n,
                    "prompt_ids": [3, 4 + g, 5][g % 2 :],
                    "completion_ids": [6 + (s + k + g) % 5 for k in range(n)] + [2],
                    "completion_logprobs": [-1.0] * (n + 1),
                    "completion_length": n + 1,
                    "finish_reason": "stop",
                    "policy_id": "p",
                    "iteration": 0,
                    "r": float((s + g) % 2) + 0.1 * s,
                }
            )
    rollouts = f"{directory}/rollouts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), rollouts)
    out = f"{directory}/scored.parquet"
    score_file(rollouts, out, {f"{__file__}:column_reward": 1.0})
    return out


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def gather_memory(data_parallel, checkpoint: str, out_dir: str) -> None:
    """A sharded model with AdamW state, then :meth:`checkpoint_state` (the gather a
    checkpoint makes); each rank saves how far its peak RSS rose during the gather (Linux:
    the peak is reset first) and what it received."""
    import gc

    from grpo_core.training.fsdp import ShardedDataParallel
    from grpo_core.training.optim import build_optimizer
    from grpo_core.training.train_state import TrainState

    dp = ShardedDataParallel(data_parallel.group)
    model, _ = load_checkpoint(checkpoint)
    dp.wrap(model)
    opt = build_optimizer(model, "adamw_torch", lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW's moments exist (as shards)
    train = TrainState({}, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), 1, {})
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    state, weights = dp.checkpoint_state(model, train)
    rose = (_rss_kib("VmHWM") - before) * 1024
    moments = state["optimizer"].get("state", {})  # rank != 0: {}
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    out = {
        "rose": rose,
        "weights": sum(v.numel() * v.element_size() for v in weights.values()),
        "moments": len(moments),
        "plain": sorted(k for k, p in params.items() if not isinstance(p, DTensor)),
        "local": sum(p.to_local().numel() * p.element_size() for p in params.values()),
    }
    torch.save(out, f"{out_dir}/gather{dp.rank}.pt")


BF16_CASE = dict(loss=dict(loss_type="dapo"), update=dict(steps_per_generation=2, bf16=True))


def bf16_update(checkpoint: str, data_parallel=None) -> dict:
    """One bf16-autocast update (AdamW) of 6 groups; with ``data_parallel`` (a sharded rank)
    the dtypes its layers ran in and its shards and gradients hold."""
    from grpo_core.training.optim import build_optimizer

    model, tok = load_checkpoint(checkpoint)
    seen: set = set()
    if data_parallel is not None:
        data_parallel.wrap(model)
        layer = model.get_decoder().layers[0]
        layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.add(str(m.weight.dtype)))
    opt = build_optimizer(model, "adamw_torch_foreach", lr=1e-3)
    cfg = UpdateConfig(
        loss=LossConfig(**BF16_CASE["loss"]), entropy_of_skipped_rows=False, **BF16_CASE["update"]
    )
    history = grpo_update(model, opt, None, batch(6, tok.pad_token_id), cfg,
                          data_parallel=data_parallel)  # fmt: skip
    out = {"losses": [h["loss"] for h in history], "ran_in": sorted(seen)}
    out["shards"] = sorted({str(p.dtype) for p in model.parameters()})
    out["moments"] = sorted({str(s["exp_avg"].dtype) for s in opt.state.values()})
    out["auto"] = auto_decisions(model)
    return out


def auto_decisions(model) -> dict:
    """What the ``auto`` rules decide for a file the hf engine sampled in float32 with the
    policy being updated, as they see ``model`` (its compute dtype) without autocast."""
    from grpo_core.logprobs.old import engine_correction_choice, old_logprobs_source
    from grpo_core.training.checkpoint import compute_dtype_name

    meta = {"engine": "hf", "dtype": "float32", "sampling": {"temperature": 1.0}}
    dtype = compute_dtype_name(model)
    correction, _ = engine_correction_choice("auto", file_meta=meta, model_dtype=dtype)
    source, _ = old_logprobs_source("auto", file_meta=meta, policy_ids={"p"}, policy_id="p",
                                    temperature=1.0, model_dtype=dtype)  # fmt: skip
    return {"compute_dtype": dtype, "correction": correction, "old_logprobs": source}


def run_bf16_sharded(data_parallel, checkpoint: str, out_dir: str) -> None:
    from grpo_core.training.fsdp import ShardedDataParallel

    dp = ShardedDataParallel(data_parallel.group, param_dtype="bfloat16")
    torch.save(bf16_update(checkpoint, dp), f"{out_dir}/bf16-rank{dp.rank}.pt")


def ess_over_ranks(data_parallel, out_dir: str) -> None:
    """Rank r holds half of a batch's behaviour weights (rank 0 all equal, rank 1 spread):
    each rank writes the ESS ``importance_metrics`` reports."""
    import json
    from pathlib import Path

    from grpo_core.algorithm.importance import behaviour_weights, ess_parts

    gen = torch.Generator().manual_seed(data_parallel.rank)
    prox = torch.zeros(4, 6, dtype=torch.float64)
    samp = prox - (0.0 if data_parallel.rank == 0 else 3 * torch.rand(4, 6, generator=gen))
    mask = torch.ones(4, 6)
    w, metrics = behaviour_weights(prox, samp, mask, mode="token_truncate", cap=50.0)
    out = data_parallel.importance_metrics(metrics, float(mask.sum()), ess_parts(w, mask))
    Path(out_dir, f"rank{data_parallel.rank}.json").write_text(
        json.dumps(
            {
                "ess": out["sampling/behaviour_weight/ess"],
                "local": metrics,
                "w": w.flatten().tolist(),
            }
        )  # fmt: skip
    )
