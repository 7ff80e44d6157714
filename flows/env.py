"""Process environment defaults: the one place they are set for Python code.

Offline, quiet, local: no Prefect analytics or MLflow telemetry, no Hugging Face Hub
downloads. Each entry point calls :func:`apply_defaults` before Prefect or MLflow is imported
(both read these variables at import): the ``grpo`` CLI (flows/cli.py), the deployments
(flows/deployments.py: a deployment's flow run starts in a bare worker process) and the test
suite (tests/conftest.py). A user's own settings win (``os.environ.setdefault``).
The shell scripts and compose file in infra/ export a copy of the server-side ones.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # A tracking server that goes away mid-run fails a call after 2 retries (1 s backoff,
    # 30 s timeout per try), not MLflow's 7 retries with backoff 2 and a 120 s timeout
    # (minutes); one that is down before the run is found up front (flows/preflight/).
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    # MLflow prints "View run ... at" for every run it ends on a server, with links that open
    # its UI in GenAI mode; `grpo run` prints its own (tasks/tracking/stages.py: UI_MODE)
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# Route the project's own loggers through Prefect's handlers, so flow runs show them in the UI.
FLOW_LOGS = {"PREFECT_LOGGING_EXTRA_LOGGERS": "grpo_core,tasks,flows,cluster"}


def apply_defaults(output_dir: str | Path | None = None, *, flow_logs: bool = True) -> None:
    """Set the defaults that are not set yet.

    ``output_dir``: also keep Hugging Face caches beside a run's outputs and quiet
    transformers' progress bars and warnings (through the environment, so transformers is
    imported only when used). ``flow_logs=False`` leaves Python logging alone (tests).
    """
    for key, value in {**DEFAULTS, **(FLOW_LOGS if flow_logs else {})}.items():
        os.environ.setdefault(key, value)
    if output_dir is not None:
        os.environ.setdefault("HF_HOME", str(Path(output_dir).resolve() / ".hf_home"))
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
