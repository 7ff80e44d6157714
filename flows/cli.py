"""``grpo``: the command line.

grpo run [--config FILE] [--set section.key=value ...] [--force STAGE]
grpo rollout --policy CKPT | score --rollouts R.parquet | update --scored S --policy CKPT
     | eval --checkpoint CKPT                          (one stage from files; flows/stages.py)
grpo compare [RUN ...]                                 (stages x metrics across runs; PNG plot)
grpo serve                                             (deployments for the Prefect UI)
grpo import-gguf FILE.gguf OUT_DIR | --pypi SPEC OUT_DIR  (a GGUF as a save_pretrained dir)
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import logging
import sys

from flows import errors, local_server
from flows.cli_args import add_config_args
from flows.env import apply_defaults

# Offline, quiet, local defaults, set before Prefect is imported (it reads them at import);
# a user's own settings win.
apply_defaults()


def _overrides(args: argparse.Namespace) -> list[str]:
    return [*args.set, *([f"force={args.force}"] if getattr(args, "force", None) else [])]


def cmd_run(args: argparse.Namespace) -> int:
    from flows.config import load_config

    cfg = load_config(args.config, _overrides(args))
    from flows import preflight

    preflight.check_run(cfg)  # before Prefect starts: a bad input is one line, nothing written
    apply_defaults(cfg.output_dir)
    from flows import interrupts
    from flows.lock import WorkspaceBusy, acquire_workspace

    try:  # one run per workspace; the kernel drops the lock when this process ends
        acquire_workspace(cfg.output_dir, cfg.run_name)
    except WorkspaceBusy as e:
        print(f"grpo: error: {e}", file=sys.stderr)
        return 2
    interrupts.install()  # Ctrl-C / SIGTERM: runs marked KILLED, one line, exit 130 / 143
    server = local_server.start()  # starts while the imports below run
    try:
        from flows.r1 import r1_pipeline
        from flows.summary import render_summary
        from tasks.tracking.stages import Tracking

        # Open the MLflow store while the Prefect server is still starting: the first open of
        # a sqlite store checks (or creates) its schema, ~2 s that would otherwise come after.
        store = Tracking.open(cfg.tracking.uri, cfg.tracking.experiment)
        print(f"MLflow: runs go to {cfg.tracking.uri} ({cfg.tracking.uri_source})", flush=True)
        if store.experiment_url():
            print(f"MLflow UI: {store.experiment_url()}", flush=True)
        with local_server.attach(server):
            summary = r1_pipeline(cfg)
        summary["tracking_uri_source"] = cfg.tracking.uri_source
    except BaseException as e:
        code = interrupts.finish(e, stop_server=server and (lambda: server.stop(drain=False)))
        if code is None:
            raise
        return code
    render_summary(summary)
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from flows.config import load_config

    cfg = load_config(args.config, args.set)  # validate before starting Prefect
    from flows import preflight

    preflight.check_stage(args.command, args, cfg)
    apply_defaults(cfg.output_dir)
    from flows import interrupts

    interrupts.install()  # Ctrl-C / SIGTERM: one line, exit 130 / 143 (outputs are atomic)
    server = local_server.start()
    try:
        from flows import stages

        common = {"config": args.config, "overrides": args.set}
        with local_server.attach(server):
            if args.command == "rollout":
                out = stages.rollout_flow(
                    args.policy, args.data, args.iteration, args.out, **common
                )
            elif args.command == "score":
                out = stages.score_flow(args.rollouts, args.out, **common)
            elif args.command == "update":
                out = stages.update_flow(args.scored, args.policy, args.out, **common)
            else:
                out = stages.eval_flow(args.checkpoint, args.data, args.out, **common)
    except BaseException as e:
        code = interrupts.finish(
            e, stop_server=server and (lambda: server.stop(drain=False)), step=args.command
        )
        if code is None:
            raise
        return code
    print(json.dumps(out, indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo", description="The R1 recipe as Prefect stages tracked in MLflow."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the whole pipeline (the embedded CPU demo by default)")
    add_config_args(run)
    run.add_argument(
        "--force",
        action="append",
        default=[],
        metavar="STAGE",
        help="rerun STAGE even if its inputs are unchanged (repeatable; 'all' for every stage)",
    )
    run.set_defaults(func=cmd_run)

    p = sub.add_parser("rollout", help="sample rollouts from a checkpoint into a rollouts Parquet")
    p.add_argument("--policy", required=True, help="checkpoint directory (save_pretrained)")
    p.add_argument("--data", help="prompt file (default: the config's RL split)")
    p.add_argument("--iteration", type=int, default=0, help="which slice of the prompts to take")
    p.add_argument("--out", help="output Parquet")
    p = sub.add_parser(
        "score", help="re-score a rollouts Parquet with the config's reward mix (new file)"
    )
    p.add_argument("--rollouts", required=True)
    p.add_argument(
        "--out",
        help="output scored Parquet (default: beside the rollouts, named by the reward mix)",
    )
    p = sub.add_parser("update", help="offline GRPO update of a checkpoint from any scored Parquet")
    p.add_argument("--scored", required=True)
    p.add_argument("--policy", required=True, help="checkpoint directory to update")
    p.add_argument("--out", help="output checkpoint directory")
    p = sub.add_parser("eval", help="greedy held-out evaluation of a checkpoint")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", help="prompt file (default: the config's eval split)")
    p.add_argument("--out", help="output eval table Parquet")
    for name in ("rollout", "score", "update", "eval"):
        sp = sub.choices[name]
        add_config_args(sp)
        sp.set_defaults(func=cmd_stage)

    from flows.compare import add_compare_parser
    from flows.import_gguf import add_import_gguf_parser
    from flows.serve_cli import add_serve_parser

    add_serve_parser(sub)
    add_compare_parser(sub)
    add_import_gguf_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Registered first, so it runs last at exit: moves every object to the permanent GC
    # generation so that interpreter shutdown skips a full cyclic collection over the
    # million objects prefect/mlflow/torch leave (~0.9 s of a cached rerun's ~15 s).
    atexit.register(gc.freeze)
    args = build_parser().parse_args(argv)
    if args.func not in (cmd_run, cmd_stage):  # flows log through Prefect's handlers
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    for noisy in ("httpx", "httpcore", "alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    errors.quiet_prefect_tracebacks()  # known errors: Prefect logs one line, no traceback
    try:
        return args.func(args)
    except Exception as e:  # a known error is one line (flows/errors.py); a bug keeps its traceback
        message = errors.user_message(e)
        if message is None or errors.debug():
            raise
        print(f"grpo: error: {message}", file=sys.stderr)
        return errors.EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
