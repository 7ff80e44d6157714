"""One data-parallel GRPO update from a scored Parquet and a checkpoint, as ``grpo update``
does in one process, on N ranks launched by ``torchrun``::

    torchrun --nproc-per-node 2 -m flows.ddp_update \\
        --policy CKPT --scored scored.parquet --out NEW_CKPT [--config gpu.yaml] [--set k=v]

Every rank reads the whole file and the checkpoint, trains its share of each micro-batch's
groups (``grpo_core.training.distributed``), and rank 0 writes the checkpoint (atomically, with the
trainer state). The policy loads as the config's ``model`` section says (``dtype``, ``lora``,
``gradient_checkpointing``, ``load_in_4bit``: the run context sets it on every rank), and the
summary line names what was trained. The backend is nccl when CUDA is available (one GPU per
rank, ``LOCAL_RANK``), else gloo; ``--backend`` chooses. No Prefect flow run or MLflow run is
made: this is the update alone, the piece that the cluster orchestration will launch.
"""

from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flows.ddp_update",
        description="data-parallel GRPO update of a checkpoint from a scored Parquet "
        "(run under torchrun --nproc-per-node N)",
    )
    p.add_argument("--scored", required=True, help="scored Parquet")
    p.add_argument("--policy", required=True, help="checkpoint directory to update")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument(
        "--reference", help="reference checkpoint for beta > 0 (default: the policy itself)"
    )
    p.add_argument("--config", help="YAML preset (default: the packaged configs/demo.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl with CUDA, else gloo")
    p.add_argument(
        "--strategy",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="ddp: a replica per rank; fsdp: decoder layers sharded (FSDP2)",
    )
    p.add_argument(
        "--fsdp-param-dtype",
        choices=["bfloat16", "float32"],
        help="fsdp: all-gather and run the layers in this dtype (gradients reduced in float32)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from flows.config import load_config
    from flows.env import apply_defaults
    from flows.run_context import RunContext

    cfg = load_config(args.config, args.set)
    apply_defaults(cfg.output_dir)
    RunContext.open(cfg)  # every rank pulls what its node lacks from storage.url (if set)
    from grpo_core.training.distributed import process_group
    from tasks.policies import loading
    from tasks.policies.trainer import open_trainer
    from tasks.update import UpdateRequest, update_from_file

    with process_group(args.backend, args.strategy, args.fsdp_param_dtype) as dp:
        reference = args.reference or args.policy
        request = UpdateRequest(args.policy, args.scored, args.out, cfg.rl,
                                reference_checkpoint=reference, seed=args.seed)  # fmt: skip
        trainer = open_trainer()
        res = update_from_file(request, data_parallel=dp, trainer=trainer)
        if dp.rank == 0:
            last = res.history[-1] if res.history else {}
            summary = {
                "checkpoint": res.checkpoint,
                "world_size": dp.world_size,
                "global_step": res.global_step,
                "steps": len(res.history),
                "seconds": res.seconds,
                "loss": last.get("loss"),
                # the model the ranks trained, as the config's model section loaded it
                "model": loading.describe(trainer.held().learner.model),
            }
            print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
