"""``grpo``: the command line.

grpo run [--config FILE] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _environment(output_dir: str) -> None:
    """Offline, quiet, local defaults; a user's own settings win."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HOME", str(Path(output_dir).resolve() / ".hf_home"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "grpo_core,tasks,flows")


def cmd_run(args: argparse.Namespace) -> int:
    from grpo_core.config import load_config

    cfg = load_config(args.config, [*args.set, *([f"force={args.force}"] if args.force else [])])
    _environment(cfg.output_dir)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    from flows.r1 import r1_pipeline
    from flows.summary import render_summary

    summary = r1_pipeline(cfg)
    render_summary(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="grpo", description="The R1 recipe as Prefect stages tracked in MLflow."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the whole pipeline (the embedded CPU demo by default)")
    run.add_argument("--config", help="YAML preset (default: the packaged configs/demo.yaml)")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set rl.learning_rate=1e-5 (repeatable)",
    )
    run.add_argument(
        "--force",
        action="append",
        default=[],
        metavar="STAGE",
        help="rerun STAGE even if its inputs are unchanged (repeatable; 'all' for every stage)",
    )
    run.set_defaults(func=cmd_run)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "httpcore", "alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"grpo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
