"""``grpo serve``'s command line, kept apart from flows/deployments.py so that building the
``grpo`` parser does not import Prefect (flows/cli.py starts Prefect's server first).

``python -m flows.serve_cli [serve options]`` is `grpo serve` without the CLI. This module
imports flows/deployments.py (when serving), never the other way round."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from flows.cli_args import add_config_args
from flows.config import DEFAULT_CRON


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``grpo serve`` to the CLI's subparsers (it sets ``func=serve_main``)."""
    p = subparsers.add_parser(
        "serve",
        help="register the Prefect deployments and run what the UI/schedules trigger",
        description="Registers the r1-pipeline and stage deployments with the Prefect server "
        "in PREFECT_API_URL and runs their flow runs in this process (Ctrl-C to stop).",
    )
    add_config_args(
        p,
        config_help="default YAML preset of the r1-pipeline deployment (editable per run)",
        set_help="default override of the r1-pipeline deployment (repeatable; editable per run)",
    )
    p.add_argument(
        "--cron",
        default=DEFAULT_CRON,
        help=f"example schedule, created paused (default '{DEFAULT_CRON}'); '' for none",
    )
    p.add_argument(
        "--limit", type=int, default=1, help="flow runs at the same time (default 1; 0: no limit)"
    )
    p.add_argument("--no-stages", action="store_true", help="serve only the r1-pipeline deployment")
    p.set_defaults(func=serve_main)
    return p


def serve_main(args: argparse.Namespace) -> int:
    if args.config and not os.path.exists(args.config):
        raise FileNotFoundError(f"config file {args.config} does not exist")
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        print(
            "note: PREFECT_API_URL is not set, so the deployments go to a temporary in-process "
            "Prefect server that no UI can reach. Start one with infra/start-servers.sh and "
            "`source .grpo-servers/env.sh` (docs/team.md).",
            file=sys.stderr,
        )
    from flows.deployments import serve_all

    serve_all(
        cron=args.cron or None,
        limit=args.limit or None,
        stages=not args.no_stages,
        config=os.path.abspath(args.config) if args.config else None,
        overrides=args.set,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.serve_cli [serve options]``: `grpo serve` without the CLI."""
    from flows.env import apply_defaults

    apply_defaults()  # as flows/cli.py does for `grpo serve`, before Prefect is imported
    parser = argparse.ArgumentParser(prog="python -m flows.serve_cli")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    args = parser.parse_args(["serve", *(argv if argv is not None else sys.argv[1:])])
    logging.basicConfig(level=logging.INFO)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
