"""``grpo compare [RUN ...]``: stages x metrics across pipeline runs, from MLflow.

Reads what a pipeline logged (the parent run's ``stages/<n>_<stage>/<metric>`` metrics, its
held-out numbers and wall time, and each RL stage run's ``train/reward`` per iteration),
prints one table, writes a
PNG (held-out accuracy per stage; mean reward per RL iteration) and logs that PNG as an
artifact (``compare/<file>``) of every parent run compared. RUN is a parent run id or a run
name (the latest parent run with that name); no RUN: the latest parent run of the experiment.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from flows.cli_args import add_config_args

EVAL_METRICS = ("accuracy", "format_rate", "mean_length")
PIPELINE_FILTER = "tags.pipeline = 'r1'"
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass
class StageResult:
    stage: str
    eval: dict[str, float] = field(default_factory=dict)  # accuracy, format_rate, mean_length
    rewards: list[float] = field(default_factory=list)  # mean reward per RL iteration
    wall_time_s: float | None = None


@dataclass
class PipelineRun:
    run_id: str
    name: str
    stages: list[StageResult]

    @property
    def label(self) -> str:
        return f"{self.name} ({self.run_id[:8]})"


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def resolve_runs(client, refs: list[str], experiment: str | None) -> list:
    """MLflow runs for ``refs`` (run ids or names); none: the latest pipeline parent run."""
    from mlflow.exceptions import MlflowException

    exp_ids = None
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise ValueError(f"MLflow experiment {experiment!r} not found at {client.tracking_uri}")
        exp_ids = [exp.experiment_id]
    if exp_ids is None:
        exp_ids = [e.experiment_id for e in client.search_experiments()]

    def latest(filter_string: str):
        found = client.search_runs(
            exp_ids, filter_string, order_by=["attributes.start_time DESC"], max_results=1
        )
        return found[0] if found else None

    if not refs:
        run = latest(PIPELINE_FILTER)
        if run is None:
            raise ValueError(f"no pipeline run (tag pipeline=r1) in experiment {experiment!r}")
        return [run]
    runs = []
    for ref in refs:
        run = None
        if _RUN_ID.match(ref):
            try:
                run = client.get_run(ref)
            except MlflowException:
                run = None
        if run is None:
            name = ref.replace("'", "\\'")
            run = latest(f"{PIPELINE_FILTER} and attributes.run_name = '{name}'")
        if run is None:
            raise ValueError(f"no pipeline run with id or name {ref!r}")
        runs.append(run)
    return runs


def _reward_curve(client, run_id: str) -> list[float]:
    """Mean reward per RL iteration: ``train/reward`` (one point per iteration); a run
    logged before the chart keys: ``reward``, joined to its ``iteration`` metric by step."""
    history = client.get_metric_history(run_id, "train/reward")
    if history:
        return [m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))]
    rewards = sorted(
        client.get_metric_history(run_id, "reward"), key=lambda m: (m.step, m.timestamp)
    )
    iterations = {m.step: m.value for m in client.get_metric_history(run_id, "iteration")}
    if iterations:
        rewards = sorted(
            (m for m in rewards if m.step in iterations), key=lambda m: iterations[m.step]
        )
    return [m.value for m in rewards]


_STAGE_KEY = re.compile(r"^stages/\d+_(?P<stage>[^/]+)/(?P<metric>[^/]+)$")
_OLD_STAGE_KEY = re.compile(r"^(?P<stage>[^/]+)/eval/(?P<metric>[^/]+)$")


def _stage_numbers(metrics: dict) -> dict[str, dict[str, float]]:
    """The parent run's per-stage numbers: ``stages/<n>_<stage>/<metric>`` (and the
    ``<stage>/eval/<metric>`` of runs logged before)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        m = _STAGE_KEY.match(key) or _OLD_STAGE_KEY.match(key)
        if m:
            out.setdefault(m["stage"], {})[m["metric"]] = value
    return out


def load_pipeline_run(client, run) -> PipelineRun:
    from flows.config import CHECKPOINT_STAGES

    numbers = _stage_numbers(run.data.metrics)
    names = set(numbers)
    children = client.search_runs(
        [run.info.experiment_id],
        f"tags.mlflow.parentRunId = '{run.info.run_id}'",
        order_by=["attributes.start_time ASC"],
    )
    by_stage: dict[str, list] = {}
    for child in children:
        stage = child.data.tags.get("stage")
        if stage:
            by_stage.setdefault(stage, []).append(child)
    # a resumed parent run holds every attempt at a stage (the interrupted ones KILLED): the
    # last finished attempt has the whole stage (it replays the iterations it reused)
    for stage, attempts in by_stage.items():
        done = [r for r in attempts if r.info.status == "FINISHED"]
        by_stage[stage] = done[-1:] or attempts[-1:]
    names |= {s for s in by_stage if s in CHECKPOINT_STAGES}
    order = [s for s in CHECKPOINT_STAGES if s in names] + sorted(names - set(CHECKPOINT_STAGES))
    stages = []
    for name in order:
        got = numbers.get(name, {})
        result = StageResult(name, eval={m: got[m] for m in EVAL_METRICS if m in got})
        # the pipeline's own measure of the stage (as its summary shows), else the stage's
        result.wall_time_s = got.get("wall_time_s")
        for child in by_stage.get(name, []):
            result.rewards += _reward_curve(client, child.info.run_id)
            wall = child.data.metrics.get("wall_time_s")
            if wall is not None and "wall_time_s" not in got:
                result.wall_time_s = (result.wall_time_s or 0.0) + wall
        stages.append(result)
    return PipelineRun(run.info.run_id, run.info.run_name or run.info.run_id, stages)


def render_table(runs: list[PipelineRun], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped (not a terminal): wide enough that stage and run names are never cut.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    many = len(runs) > 1
    title = "held-out greedy pass@1 per stage" + (
        f" across {len(runs)} runs" if many else f": {runs[0].label}"
    )
    table = Table(title=title)
    table.add_column("stage", no_wrap=True)
    if many:
        table.add_column("run", no_wrap=True)
    for col in ("accuracy", "format rate", "mean length", "reward first->last", "wall time"):
        table.add_column(col, justify="right")

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    order = []
    for r in runs:
        order += [s.stage for s in r.stages if s.stage not in order]
    for stage in order:
        for i, r in enumerate(runs):
            s = next((x for x in r.stages if x.stage == stage), None)
            if s is None:
                continue
            reward = f"{s.rewards[0]:.3f}->{s.rewards[-1]:.3f}" if s.rewards else "-"
            length = s.eval.get("mean_length")
            cells = [
                pct(s.eval.get("accuracy")),
                pct(s.eval.get("format_rate")),
                "-" if length is None else f"{length:.1f}",
                reward,
                "-" if s.wall_time_s is None else f"{s.wall_time_s:.0f}s",
            ]
            table.add_row(stage if i == 0 or not many else "", *([r.label] if many else []), *cells)
        if many:
            table.add_section()
    console.print(table)


def plot(runs: list[PipelineRun], path: str | Path) -> Path:
    """Two panels: held-out accuracy per stage, and mean reward per RL iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_acc, ax_rew) = plt.subplots(1, 2, figsize=(12, 4.5))
    order = []
    for r in runs:
        order += [s.stage for s in r.stages if s.stage not in order and "accuracy" in s.eval]
    width = 0.8 / max(len(runs), 1)
    for i, r in enumerate(runs):
        acc = {s.stage: s.eval["accuracy"] for s in r.stages if "accuracy" in s.eval}
        xs = [j + (i - (len(runs) - 1) / 2) * width for j, st in enumerate(order) if st in acc]
        ys = [acc[st] for st in order if st in acc]
        bars = ax_acc.bar(xs, ys, width=width, label=r.label)
        ax_acc.bar_label(bars, labels=[f"{100 * y:.1f}%" for y in ys], fontsize=8)
    ax_acc.set_xticks(range(len(order)), order)
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_ylabel("held-out accuracy (greedy pass@1)")
    ax_acc.set_title("accuracy per stage")

    boundaries: dict[str, int] = {}
    for i, r in enumerate(runs):
        x0 = 0
        color = f"C{i}"
        for s in r.stages:
            if not s.rewards:
                continue
            xs = list(range(x0, x0 + len(s.rewards)))
            ax_rew.plot(
                xs, s.rewards, marker="o", ms=3, color=color, label=r.label if x0 == 0 else None
            )
            boundaries.setdefault(s.stage, x0)
            x0 += len(s.rewards)
    for stage, x in boundaries.items():
        ax_rew.axvline(x - 0.5, color="grey", lw=0.8, ls="--")
        ax_rew.annotate(
            stage,
            (x - 0.4, 1.0),
            xycoords=("data", "axes fraction"),
            va="top",
            fontsize=8,
            color="grey",
        )
    ax_rew.set_xlabel("RL iteration (stages concatenated)")
    ax_rew.set_ylabel("mean reward")
    ax_rew.set_title("reward per RL iteration")
    if not boundaries:
        ax_rew.text(0.5, 0.5, "no RL reward logged", ha="center", transform=ax_rew.transAxes)
    for ax in (ax_acc, ax_rew):
        ax.grid(alpha=0.3)
    if runs:
        ax_acc.legend(fontsize=8, loc="upper left")
    if boundaries:
        ax_rew.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare(
    tracking_uri: str,
    refs: list[str] | None = None,
    experiment: str | None = None,
    output: str | Path = "grpo-compare.png",
    log_artifact: bool = True,
    console=None,
) -> tuple[list[PipelineRun], Path]:
    """Table + PNG for the runs; the PNG is logged to each parent run under ``compare/``."""
    client = _client(tracking_uri)
    runs = [
        load_pipeline_run(client, r) for r in resolve_runs(client, list(refs or []), experiment)
    ]
    render_table(runs, console)
    png = plot(runs, output)
    if log_artifact:
        for r in runs:
            client.log_artifact(r.run_id, str(png), "compare")
    return runs, png


def add_compare_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``grpo compare`` to the CLI's subparsers (it sets ``func=compare_main``)."""
    p = subparsers.add_parser(
        "compare",
        help="table + plot of stages x metrics across pipeline runs (from MLflow)",
        description="RUN: a parent run id or run name; none: the latest pipeline run. Tracking "
        "URI and experiment come from --config/--set (as for `grpo run`) unless given.",
    )
    p.add_argument("runs", nargs="*", metavar="RUN")
    add_config_args(
        p,
        config_help="YAML preset whose tracking section to use (default: demo)",
        set_help="config override, e.g. --set tracking.uri=http://127.0.0.1:5000",
    )
    p.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: as `grpo run` resolves it: --set tracking.uri, "
        "the config file, MLFLOW_TRACKING_URI, sqlite:///mlflow.db)",
    )
    p.add_argument("--experiment", help="MLflow experiment (default: the config's)")
    p.add_argument(
        "-o", "--output", default="grpo-compare.png", help="PNG path (default ./grpo-compare.png)"
    )
    p.add_argument("--no-log", action="store_true", help="don't log the PNG to the parent runs")
    p.set_defaults(func=compare_main)
    return p


def compare_main(args: argparse.Namespace) -> int:
    from flows.config import load_config

    cfg = load_config(args.config, args.set)
    uri = args.tracking_uri or cfg.tracking.uri  # --set, config file, env, default
    experiment = args.experiment or (None if args.runs else cfg.tracking.experiment)
    _, png = compare(uri, args.runs, experiment, args.output, log_artifact=not args.no_log)
    print(f"plot: {png}" + ("" if args.no_log else " (logged to each parent run under compare/)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.compare [RUN ...]``: `grpo compare` without the CLI."""
    from flows.env import apply_defaults

    apply_defaults()  # before MLflow is imported
    parser = argparse.ArgumentParser(prog="python -m flows.compare")
    sub = parser.add_subparsers(dest="command")
    add_compare_parser(sub)
    args = parser.parse_args(["compare", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"grpo compare: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
