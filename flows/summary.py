"""The closing summary printed in the terminal after a pipeline run, and the Prefect
artifacts (one per stage, one for the pipeline) that show it in the Prefect UI."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from tasks.tracking.stages import Tracking
from tasks.tracking.store import sqlite_path
from tasks.workspace import Workspace

COMPARE_PLOT = "compare/grpo-compare.png"  # the parent run's artifact, logged at every run end


def _settings(section) -> str:
    """A config section's settings that differ from the defaults, as ``key=value`` text."""
    shown = section.model_dump(exclude_defaults=True, exclude_none=True)
    return ", ".join(f"{k}={v}" for k, v in shown.items()) or "defaults"


def run_note(cfg, parent_run_id: str, rows: list[dict] | None = None) -> str:
    """The parent run's MLflow description (``mlflow.note.content``): the stage table once
    known, the comparison plot (stages by name), then what ran (settings that differ from
    the defaults; the whole config is the ``config.yaml`` artifact)."""
    from flows.config import CHECKPOINT_STAGES

    lines = []
    if rows:
        lines += [
            "| stage | held-out accuracy | format rate | mean length | wall time |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['stage']} | {100 * r['accuracy']:.1f}% | {100 * r['format_rate']:.1f}% "
            f"| {r['mean_length']:.1f} | {r['wall_time_s']:.0f}s |"
            for r in rows
        ]
        plot = f"get-artifact?path={COMPARE_PLOT.replace('/', '%2F')}&run_uuid={parent_run_id}"
        lines += ["", f"![held-out accuracy per stage and reward per RL iteration]({plot})", ""]
    else:
        lines += ["*Running: the stage table appears here when the pipeline ends.*", ""]
    lines += [
        f"**R1 recipe** `{cfg.run_name}`: cold_start_sft -> rl_1 -> rejection_sampling -> "
        "re_sft -> rl_2, then every stage's checkpoint on the same held-out set.",
        "",
        f"- model: {_settings(cfg.model)}",
        f"- data: {_settings(cfg.data)}",
        f"- rewards: {cfg.rewards}; seed {cfg.seed}",
        f"- RL: {cfg.rl.iterations} iterations x {cfg.rl.prompts_per_iteration} prompts x "
        f"{cfg.rl.num_generations} generations, learning rate {cfg.rl.learning_rate:g}",
        "",
        "Charts: `eval/*` have one step per evaluated stage ("
        + ", ".join(f"{i} = {s}" for i, s in enumerate(CHECKPOINT_STAGES))
        + "); `stages/<n>_<stage>/*` hold each stage's numbers; the whole config is the "
        "`config.yaml` artifact.",
    ]
    return "\n".join(lines)


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
        from tasks.rejection import rejection_line

        console.print(rejection_line(rs))
    console.print(f"total time {summary['total_time_s']:.0f}s; outputs in {summary['workspace']}")
    if summary.get("registered_model"):
        from flows.model_registry import registration_line

        line = registration_line(summary["registered_model"], summary.get("champion"))
        console.print(f"final checkpoint {line} in the MLflow model registry")
    console.print("\nWhere to look next:")
    for line in where_to_look(summary):
        console.print(f"  {line}")


def mlflow_hint(uri: str, experiment_url: str | None = None) -> str:
    """How to open the MLflow UI on ``uri``: the experiment's runs table on a tracking server
    (``experiment_url``, else the server's URL), or the ``mlflow ui`` command for a sqlite
    file (with its absolute path) or a folder store."""
    if uri.startswith(("http://", "https://")):
        return f"open {experiment_url or uri.rstrip('/')}"
    path = sqlite_path(uri)
    if path is not None:
        return f"mlflow ui --backend-store-uri sqlite:///{path.resolve()}"
    return f"mlflow ui --backend-store-uri {uri}"


def where_to_look(summary: dict) -> list[str]:
    uri = summary["tracking_uri"]
    lines = [f"MLflow runs recorded at {uri} ({summary.get('tracking_uri_source', 'config')})"]
    url = summary.get("parent_run_url")
    lines.append(f"{mlflow_hint(uri, summary.get('experiment_url'))}")
    lines.append(f"  parent run: {url or summary['parent_run_id']}")
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


def md_link(text: str, url: str | None) -> str:
    return f"[{text}]({url})" if url else f"`{text}`"


def publish_sft_artifact(stage: str, result, tracking: Tracking) -> None:
    """An SFT stage's Prefect artifact (key ``<stage>-summary``), published when it ends:
    what it trained and where its MLflow run is. Its held-out numbers are the next RL
    stage's step 0 and the pipeline's summary."""
    from prefect.artifacts import create_markdown_artifact

    how = (
        "reused from the stage cache" if result.cached else f"trained in {result.wall_time_s:.0f}s"
    )
    md = (
        f"## {stage}\n\nMLflow run: {md_link(result.run_id, tracking.run_url(result.run_id))}\n\n"
        f"{result.steps} optimizer steps on {result.train_examples} examples, final loss "
        f"**{result.final_loss:.3f}**"
        + (" (stopped early at the target dev accuracy)" if result.stopped_early else "")
        + f"; {how}.\n"
    )
    create_markdown_artifact(
        key=f"{stage.replace('_', '-')}-summary", markdown=md, description=f"{stage} summary"
    )


def publish_pipeline_artifact(summary: dict, tracking: Tracking, plot: str | None) -> None:
    """The pipeline's one summary artifact (key ``pipeline-summary``): the final table,
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
        from tasks.rejection import rejection_line

        line = rejection_line(rs)
        lines.append(f"{line[0].upper()}{line[1:]}.")
    lines.append(f"\nMLflow parent run: {md_link(parent, tracking.run_url(parent))}")
    if plot:
        lines.append(
            f"\nComparison plot: {md_link(plot, tracking.run_url(parent, f'artifacts/{plot}'))}"
            f" (artifact `{plot}` of the parent run; tracking URI `{tracking.uri}`)"
        )
    if summary.get("registered_model"):
        from flows.model_registry import registration_line

        line = registration_line(summary["registered_model"], summary.get("champion"))
        lines.append(f"\nFinal checkpoint {md_cell(line, 300)} in the MLflow model registry.")
    lines.append(f"\nOutputs: `{summary['workspace']}`; total time {summary['total_time_s']:.0f}s")
    create_markdown_artifact(
        key="pipeline-summary",
        markdown="\n".join(lines),
        description=f"R1 pipeline {summary['run_name']}: held-out accuracy per stage",
    )
