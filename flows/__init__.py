"""Prefect flows and the ``grpo`` CLI. Importing any of them (from the CLI, a deployment's
worker, or a notebook) sets the offline, telemetry-free environment defaults first
(flows/env.py); a user's own settings win."""

from flows.env import apply_defaults

apply_defaults(flow_logs=False)
