"""The closing summary printed in the terminal after a pipeline run, and the Prefect
artifacts (one per stage, one for the pipeline) that show it in the Prefect UI."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from tasks.mlflow_store import sqlite_path
from tasks.tracking import Tracking
from tasks.workspace import Workspace


def render_summary(summary: dict, console: Console | None = None) -> None:
    console = console or Console(soft_wrap=True)
    table = Table(title=f"R1 pipeline '{summary['run_name']}': held-out greedy pass@1 per stage")
    for col, just in (
        ("stage", "left"),
        ("accuracy", "right"),
        ("format rate", "right"),
        ("mean length", "right"),
        ("wall time", "right"),
    ):
        table.add_column(col, justify=just)
    for r in summary["stages"]:
        table.add_row(
            r["stage"],
            f"{100 * r['accuracy']:.1f}%",
            f"{100 * r['format_rate']:.1f}%",
            f"{r['mean_length']:.1f}",
            f"{r['wall_time_s']:.0f}s",
        )
    console.print(table)
    rs = summary.get("rejection_sampling")
    if rs:
        console.print(
            f"rejection sampling kept {int(rs['kept'])} of {int(rs['sampled'])} completions "
            f"({100 * rs['acceptance_rate']:.1f}%)"
        )
    console.print(f"total time {summary['total_time_s']:.0f}s; outputs in {summary['workspace']}")
    if summary.get("registered_model"):
        console.print(f"final checkpoint registered in MLflow as {summary['registered_model']}")
    console.print("\nWhere to look next:")
    for line in where_to_look(summary):
        console.print(f"  {line}")


def mlflow_hint(uri: str) -> str:
    """How to open the MLflow UI on ``uri``: the URL of a tracking server, or the
    ``mlflow ui`` command for a sqlite file (with its absolute path) or a folder store."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')}"
    path = sqlite_path(uri)
    if path is not None:
        return f"mlflow ui --backend-store-uri sqlite:///{path.resolve()}"
    return f"mlflow ui --backend-store-uri {uri}"


def where_to_look(summary: dict) -> list[str]:
    uri = summary["tracking_uri"]
    lines = [f"MLflow runs recorded at {uri} ({summary.get('tracking_uri_source', 'config')})"]
    url = summary.get("parent_run_url")
    lines.append(f"{mlflow_hint(uri)}    (parent run {url or summary['parent_run_id']})")
    prefect = summary.get("prefect_ui")
    lines.append(
        f"Prefect: {prefect}"
        if prefect
        else "prefect server start    (the Prefect UI, then http://127.0.0.1:4200)"
    )
    first_iteration = Workspace(Path(summary["workspace"])).iteration_dir("rl_1", 0)
    lines.append(f"rollouts and scores: {first_iteration}/*.parquet (pandas / DuckDB)")
    return lines


_MD_SPECIAL = str.maketrans(
    {
        "|": "\\|",
        "\\": "\\\\",
        "`": "\\`",
        "*": "\\*",
        "_": "\\_",
        "[": "\\[",
        "]": "\\]",
        "<": "&lt;",
        ">": "&gt;",
        "&": "&amp;",
        "\n": " ",
        "\r": " ",
    }
)


def md_cell(value, limit: int = 160) -> str:
    """``value`` as the text of one markdown table cell: ``|`` cannot split the row, chat
    markup such as ``<|user|>`` is shown as text, newlines become spaces."""
    text = str(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.translate(_MD_SPECIAL)


def _md_link(text: str, url: str | None) -> str:
    return f"[{text}]({url})" if url else f"`{text}`"


def publish_stage_artifact(
    stage: str, metrics: dict, run_id: str, tracking: Tracking, samples: list[dict]
) -> None:
    """A markdown artifact per stage (key ``<stage>-summary``) so the Prefect UI shows what each
    stage did, with history across runs, and where its MLflow run is."""
    from prefect.artifacts import create_markdown_artifact

    rows = "\n".join(
        f"| {md_cell(k)} | {v:.4g} |" for k, v in metrics.items() if isinstance(v, int | float)
    )
    examples = "\n".join(
        f"| {md_cell(s.get('prompt', ''))} | {md_cell(s.get('completion', ''), 120)} "
        f"| {md_cell(s.get('correct'))} |"
        for s in samples[:5]
    )
    md = (
        f"## {stage}\n\nMLflow run: {_md_link(run_id, tracking.run_url(run_id))} "
        f"(tracking URI `{tracking.uri}`)\n\n"
        f"| metric | value |\n|---|---|\n{rows}\n\n"
        f"Held-out samples:\n\n| prompt | completion | correct |\n|---|---|---|\n{examples}\n"
    )
    create_markdown_artifact(
        key=f"{stage.replace('_', '-')}-summary", markdown=md, description=f"{stage} summary"
    )


def publish_pipeline_artifact(summary: dict, tracking: Tracking, plot: str | None) -> None:
    """The pipeline's one summary artifact (key ``r1-pipeline-summary``): the final table,
    rejection sampling, and links to the MLflow parent run and the comparison plot."""
    from prefect.artifacts import create_markdown_artifact

    parent = summary["parent_run_id"]
    table = "\n".join(
        f"| {md_cell(r['stage'])} | {100 * r['accuracy']:.1f}% | {100 * r['format_rate']:.1f}% "
        f"| {r['mean_length']:.1f} | {r['wall_time_s']:.0f}s |"
        for r in summary["stages"]
    )
    rs = summary.get("rejection_sampling") or {}
    lines = [
        f"## R1 pipeline `{md_cell(summary['run_name'])}`",
        "",
        "| stage | accuracy | format rate | mean length | wall time |",
        "|---|---|---|---|---|",
        table,
        "",
    ]
    if rs:
        lines.append(
            f"Rejection sampling kept {int(rs['kept'])} of {int(rs['sampled'])} completions "
            f"({100 * rs['acceptance_rate']:.1f}%)."
        )
    lines.append(f"\nMLflow parent run: {_md_link(parent, tracking.run_url(parent))}")
    if plot:
        url = tracking.run_url(parent)
        lines.append(
            f"\nComparison plot: {_md_link(plot, url and f'{url}/artifacts/{plot}')}"
            f" (artifact `{plot}` of the parent run; tracking URI `{tracking.uri}`)"
        )
    lines.append(f"\nOutputs: `{summary['workspace']}`; total time {summary['total_time_s']:.0f}s")
    create_markdown_artifact(
        key="r1-pipeline-summary",
        markdown="\n".join(lines),
        description=f"R1 pipeline {summary['run_name']}: held-out accuracy per stage",
    )
