"""What an RL stage shows beside its curves: the nested runs of its eval blocks, the
completion tables of the MLflow UI, and the Prefect artifact published when it ends (reward
and held-out accuracy first -> last, a per-iteration table, the held-out problems that
changed or still fail)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flows.summary import md_cell, md_link
from tasks.tracking.keys import metric_batch
from tasks.tracking.stages import Tracking

TABLE_ROWS = 20  # per-iteration rows in the artifact: every k-th iteration and the last
PROBLEM_ROWS = 5  # held-out problems shown per list
# the rewards whose answer extraction (their registration's ``extract_answer``) gives the
# "model answer" of the tables, the first that finds one: the ``<answer>`` tag, else
# ``\boxed{}``
ANSWER_REWARDS = ("accuracy", "math_verify")


@dataclass
class IterationGroup:
    """A run nested under the RL stage's run for iterations ``first..last`` (one eval
    block), named ``<stage> it <first>-<last> (<run>)``: the block's curves (its iterations
    at the stage's x-axis, its optimizer steps as ``train/by_step/*``), the eval at its end,
    and tags ``iterations``, ``policy_id`` (the block's last checkpoint), ``config_hash`` and
    ``cached``, so MLflow's compare view and ``search_runs`` can set blocks of one stage, or
    of different runs, side by side."""

    tracking: Tracking
    run_id: str
    batch: list = field(default_factory=list)
    cached: bool = True

    def add(self, metrics: dict, step: int) -> None:
        self.batch.extend(metric_batch(metrics, step))

    @classmethod
    def start(cls, tracking, stage_run_id, stage, first, last, config) -> IterationGroup:
        run_id = tracking.start_child(
            stage,
            {"iterations": f"{first}-{last}"},
            config=config,
            parent_run_id=stage_run_id,
            run_name=tracking.child_name(stage, f"it {first}-{last}"),
        )
        return cls(tracking, run_id)

    def end(self, step: int, eval_metrics: dict, policy: str) -> None:
        self.tracking.log_metric_batch(
            self.run_id,
            self.batch + metric_batch(eval_metrics, step),
            {"policy_id": policy, "cached": str(self.cached).lower()},
        )
        self.tracking.end(self.run_id)


def model_answer(completion, answer_rewards=ANSWER_REWARDS) -> str | None:
    """The answer a completion gives, for the tables: the first non-empty one that the
    registered answer extraction of a reward in ``answer_rewards`` reads (default: the
    ``<answer>`` tag, else ``\\boxed{}``); rewards without one are passed over."""
    from grpo_core import rewards

    text = completion if isinstance(completion, str) else str(completion)
    for name in answer_rewards:
        extract = rewards.spec(name).extract_answer
        found = extract(text) if extract is not None else None
        if found:
            return found
    return None


def rollout_sample(scored_path: str, n: int = 16, answer_rewards=ANSWER_REWARDS) -> list[dict]:
    """Scored completions for the MLflow UI: the best and the worst of groups spread over
    the file (not its first groups); reward, advantage, the expected and the given answer
    (:func:`model_answer` by ``answer_rewards``) first, then the texts, then the rest."""
    import pyarrow.parquet as pq

    names = pq.ParquetFile(scored_path).schema_arrow.names
    rest = [
        "finish_reason",
        "completion_length",
        *(["tool_calls", "tool_errors"] if "turns" in names else []),
        *sorted(c for c in names if c.startswith("reward_")),
    ]
    cols = ["reward", "advantage", "answer", "completion", "prompt_text", "prompt_id", "turns",
            *rest]  # fmt: skip
    rows = pq.read_table(scored_path, columns=[c for c in cols if c in names]).to_pylist()
    groups: dict = {}
    for row in rows:
        groups.setdefault(row.get("prompt_id"), []).append(row)
    keys = list(groups)
    picked = keys[:: max(1, math.ceil(len(keys) / max(1, n // 2)))][: max(1, n // 2)]
    out = []
    for key in picked:
        group = sorted(groups[key], key=lambda r: -(r.get("reward") or 0.0))
        for r in group[:1] + group[1:][-1:]:  # the best, and the worst when there are two
            shown = {k: r.get(k) for k in ("reward", "advantage", "answer")}
            shown["model_answer"] = model_answer(r.get("completion", ""), answer_rewards)
            shown["completion"] = r.get("completion")
            if r.get("turns"):  # a tool-using episode, turn by turn
                shown["trajectory"] = trajectory(r["turns"])
            shown["prompt"] = r.get("prompt_text")
            shown.update({k: r[k] for k in rest if k in r})
            out.append(shown)
    return out[:n]


def trajectory(turns: list[dict]) -> str:
    """An episode turn by turn, the tool's answers set apart: ``[model] ...`` /
    ``[tool 0.17s] ...`` (``[tool error: ...]`` when the call failed), one turn a line."""
    lines = []
    for t in turns:
        if t.get("role") == "tool":
            err = t.get("error")
            head = f"[tool error: {err[:80]}]" if err else f"[tool {t.get('seconds') or 0:.2f}s]"
        else:
            head = "[model]"
        lines.append(f"{head} {t.get('text') or ''}")
    return "\n".join(lines)


def _fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


@dataclass
class StageReport:
    """An RL stage's story as it runs, published as its Prefect artifact when it ends
    (``answer_rewards``: whose extraction gives the problems' model answer)."""

    stage: str
    rows: list[dict] = field(default_factory=list)
    evals: list[tuple[int, float, str | None]] = field(default_factory=list)
    answer_rewards: tuple[str, ...] = ANSWER_REWARDS

    def iteration(self, it: int, point: dict, cached: bool) -> None:
        self.rows.append(
            {
                "iteration": it,
                "reward": point.get("train/reward"),
                "loss": point.get("train/loss"),
                "entropy": point.get("train/entropy"),
                "length": point.get("train/completions/mean_length"),
                "tool_calls": point.get("train/tools/calls_per_completion"),
                "tool_errors": point.get("train/tools/error_rate"),
                "seconds": sum(v for k, v in point.items() if k.startswith("train/timing/")),
                "cached": cached,
            }
        )

    def evaluated(self, done: int, ev) -> None:
        self.evals.append((done, ev.accuracy, ev.table))

    def markdown(self, run_url: str | None, run_id: str, wall: float) -> str:
        acc = {done: a for done, a, _ in self.evals}
        lines = [f"## {self.stage}", "", f"MLflow run: {md_link(run_id, run_url)}", ""]
        facts = []
        if self.evals:
            (d0, a0, _), (d1, a1, _) = self.evals[0], self.evals[-1]
            facts.append(
                f"held-out accuracy **{_pct(a0)} -> {_pct(a1)}** (after {d0} -> {d1} iterations)"
            )
        rewards = [r["reward"] for r in self.rows if r["reward"] is not None]
        if rewards:
            facts.append(
                f"reward **{rewards[0]:.3f} -> {rewards[-1]:.3f}** (first -> last iteration)"
            )
        cached = sum(r["cached"] for r in self.rows)
        n = len(self.rows)
        facts.append(f"{n} iteration{'s' * (n != 1)} ({cached} reused from cache), {wall:.0f}s")
        lines += ["; ".join(facts) + ".", ""]
        tools = any(r.get("tool_calls") is not None for r in self.rows)
        extra = " tool calls / completion | tool errors |" if tools else ""
        lines += [
            "| iteration | reward | held-out accuracy | loss | entropy | completion length "
            "| seconds |" + extra,
            "|---|---|---|---|---|---|---|" + "---|---|" * tools,
        ]
        every = max(1, math.ceil(len(self.rows) / TABLE_ROWS))
        for i, r in enumerate(self.rows):
            if i % every and i != len(self.rows) - 1:
                continue
            cells = f" {_fmt(r['tool_calls'])} | {_pct(r['tool_errors'])} |" if tools else ""
            lines.append(
                f"| {r['iteration']} | {_fmt(r['reward'])} | {_pct(acc.get(r['iteration'] + 1))} "
                f"| {_fmt(r['loss'])} | {_fmt(r['entropy'])} | {_fmt(r['length'])} "
                f"| {r['seconds']:.1f} |" + cells
            )
        lines += self._problems()
        return "\n".join(lines) + "\n"

    def _problems(self) -> list[str]:
        """Held-out problems solved or lost between the first and the last eval, and those
        still failing."""
        tables = [t for _, _, t in self.evals if t]
        if not tables:
            return []
        before = _by_problem(tables[0], self.answer_rewards) if len(tables) > 1 else {}
        after = _by_problem(tables[-1], self.answer_rewards)
        solved = [p for p, r in after.items() if p in before and r["score"] > before[p]["score"]]
        lost = [p for p, r in after.items() if p in before and r["score"] < before[p]["score"]]
        failing = [  # at the last eval and, when there is one, at the first
            p for p, r in after.items() if r["score"] == 0.0 and before.get(p, r)["score"] == 0.0
        ]
        out = ["", f"### Held-out problems ({len(after)})"]
        for title, probs in (
            ("Solved now, not at the first eval", solved),
            ("Lost since the first eval", lost),
            ("Still failing" if before else "Failing", failing),
        ):
            if not before and title != "Failing":
                continue
            out += ["", f"{title}: {len(probs)}"]
            if probs:
                out += ["", "| problem | answer | model answer | completion |", "|---|---|---|---|"]
                for p in probs[:PROBLEM_ROWS]:
                    r = after[p]
                    out.append(
                        f"| {md_cell(p, 80)} | {md_cell(r['answer'], 40)} "
                        f"| {md_cell(r['model_answer'] or '-', 40)} "
                        f"| {md_cell(r['completion'], 120)} |"
                    )
        return out

    def publish(self, tracking: Tracking, run_id: str, wall: float) -> None:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(
            key=f"{self.stage.replace('_', '-')}-summary",
            markdown=self.markdown(tracking.run_url(run_id), run_id, wall),
            description=f"{self.stage}: reward and held-out accuracy, first -> last",
        )


def _by_problem(table: str, answer_rewards=ANSWER_REWARDS) -> dict[str, dict]:
    """An eval table's rows by prompt: the mean score of its samples, and one completion."""
    import pyarrow.parquet as pq

    out: dict[str, dict] = {}
    for row in pq.read_table(table).to_pylist():
        p = out.setdefault(
            str(row.get("prompt")),
            {
                "scores": [],
                "answer": row.get("answer"),
                "completion": row.get("completion"),
                "model_answer": model_answer(row.get("completion", ""), answer_rewards),
            },
        )
        p["scores"].append(float(row.get("correct") or 0.0))
    for p in out.values():
        p["score"] = sum(p["scores"]) / len(p["scores"])
    return out
