"""The closing summary printed in the terminal after a pipeline run."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

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
    uri = summary["tracking_uri"]
    console.print("\nWhere to look next:")
    console.print(
        f"  mlflow ui --backend-store-uri {uri}    (parent run {summary['parent_run_id']})"
    )
    console.print(
        "  prefect server start                      (the Prefect UI, then http://127.0.0.1:4200)"
    )
    first_iteration = Workspace(Path(summary["workspace"])).iteration_dir("rl_1", 0)
    console.print(f"  rollouts and scores: {first_iteration}/*.parquet (pandas / DuckDB)")


def publish_stage_artifact(
    stage: str, metrics: dict, run_id: str, tracking_uri: str, samples: list[dict]
) -> None:
    """A markdown artifact per stage (key ``<stage>-summary``) so the Prefect UI shows what each
    stage did, with history across runs, and where its MLflow run is."""
    from prefect.artifacts import create_markdown_artifact

    rows = "\n".join(f"| {k} | {v:.4g} |" for k, v in metrics.items() if isinstance(v, int | float))
    examples = "\n".join(
        f"| `{s.get('prompt', '')}` | `{str(s.get('completion', ''))[:120]}` | {s.get('correct')} |"
        for s in samples[:5]
    )
    link = (
        f"{tracking_uri.rstrip('/')}/#/experiments/runs/{run_id}"
        if tracking_uri.startswith("http")
        else run_id
    )
    md = (
        f"## {stage}\n\nMLflow run: {link} (tracking URI `{tracking_uri}`)\n\n"
        f"| metric | value |\n|---|---|\n{rows}\n\n"
        f"Held-out samples:\n\n| prompt | completion | correct |\n|---|---|---|\n{examples}\n"
    )
    create_markdown_artifact(
        key=f"{stage.replace('_', '-')}-summary", markdown=md, description=f"{stage} summary"
    )
