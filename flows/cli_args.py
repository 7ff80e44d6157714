"""Command-line options that several ``grpo`` commands share (no heavy imports: the parser is
built before Prefect starts)."""

from __future__ import annotations

import argparse


def add_config_args(
    p: argparse.ArgumentParser,
    *,
    config_help: str = "YAML preset (default: the packaged configs/demo.yaml)",
    set_help: str = "override a config value, e.g. --set rl.learning_rate=1e-5 (repeatable)",
) -> None:
    """``--config`` (a YAML preset) and ``--set KEY=VALUE`` (repeatable overrides)."""
    p.add_argument("--config", help=config_help)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)
