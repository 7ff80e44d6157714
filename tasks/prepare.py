"""Stage 0: the inputs. For the demo, make the data splits and the tiny base model; for a
user's model and data, check the files and point the pipeline at them."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster import storage
from grpo_core.config.stages import DataConfig, ModelConfig
from grpo_core.contracts.io import write_jsonl
from grpo_core.contracts.prompts import load_rows
from grpo_core.demo.task import make_splits
from grpo_core.errors import UserError
from grpo_core.training.checkpoint import policy_id, resolve_model_path
from tasks.run_log import logger, pull
from tasks.workspace import Workspace

SPLIT_COLUMNS = {
    "sft": ("prompt", "completion"),
    "rl": ("prompt",),
    "dev": ("prompt",),
    "eval": ("prompt",),
}


def generated_splits(data: DataConfig, seed: int):
    """The built-in tasks' splits (``demo``: addition, ``word_problems``), rows in the
    pipeline's format."""
    if data.source == "demo":
        d = data.demo
        return make_splits(seed, d.digits, d.n_sft, d.n_rl, d.n_dev, d.n_eval)
    if data.source == "multiply":
        from grpo_core.demo.multiply import make_splits as multiply_splits

        return multiply_splits(seed, **data.multiply.model_dump())
    from grpo_core.demo.word_problems import make_splits as word_problem_splits

    return word_problem_splits(seed, **data.word_problems.model_dump())


def _declared(rows: list[dict], tools: str | dict | None, source: str = "data") -> list[dict]:
    """``rows`` with the ``tools`` column where they have none (``tools`` None: as they are;
    a mapping: per environment name, for rows that name theirs in ``environment``)."""
    if not tools:
        return rows
    if isinstance(tools, str):
        return [r if r.get("tools") else {**r, "tools": tools} for r in rows]
    from grpo_core.engines.factory_env import row_environment

    out = []
    for i, r in enumerate(rows):
        try:
            name = row_environment(r, {k: k for k in tools}, f"{source}, row {i}")
        except ValueError as e:
            raise UserError(str(e)) from None
        out.append(r if r.get("tools") else {**r, "tools": tools[name]})
    return out


@task(name="prepare", cache_policy=NO_CACHE)
def prepare(
    data: DataConfig, model: ModelConfig, seed: int, ws: Workspace, tools: str | dict | None = None
) -> dict[str, str]:
    """Returns paths: ``base`` checkpoint and ``sft``/``rl``/``dev``/``eval`` data.

    ``tools``: the function tools' JSON schemas (``rollout.functions``, as JSON): every row
    without a ``tools`` column of its own gets it, so the chat template declares them
    (grpo_core/contracts/text.py); the files are then written to ``data/``.

    Generated data is written to the run's ``data/`` folder. A user's JSONL, JSON or Parquet
    file is used where it is when it already has the pipeline's columns; mapped rows (a column
    mapping, template, preset or system prompt), CSV files and ``datasets`` folders are
    written to ``data/<split>.jsonl`` instead."""
    log = logger(__name__)
    out: dict[str, str] = {}
    mapping = data.mapping()
    if data.source in ("demo", "word_problems", "multiply"):
        splits = generated_splits(data, seed)
        for name in ("sft", "rl", "dev", "eval"):
            rows = getattr(splits, name)
            if rows:
                rows = mapping.apply(rows, f"{data.source} {name} split", sft=name == "sft")
                out[name] = str(write_jsonl(_declared(rows, tools, name), ws.data(name)))
        log.info(
            "%s data: %s",
            data.source,
            {k: len(getattr(splits, k)) for k in ("sft", "rl", "dev", "eval")},
        )
    else:
        for name, path in (
            ("sft", data.sft_path),
            ("rl", data.rl_path),
            ("dev", data.dev_path),
            ("eval", data.eval_path),
        ):
            if path is None:
                continue
            # fail early, naming file and row
            rows = load_rows(
                path,
                required=SPLIT_COLUMNS[name],
                max_prompt_chars=data.max_prompt_chars,
                mapping=mapping,
            )
            as_is = Path(path).is_file() and Path(path).suffix in (".jsonl", ".json", ".parquet")
            if mapping.identity and as_is and not tools:
                out[name] = str(Path(path).resolve())
            else:  # mapped rows, or a datasets folder / CSV: one JSONL file the stages hash
                out[name] = str(write_jsonl(_declared(rows, tools, name), ws.data(name)))
    if model.source == "demo":
        base = ws.checkpoint("base")
        pull(base)  # another machine's run of this workspace made it already
        if not (base / "config.json").exists():
            from grpo_core.demo.model import save_base_model

            save_base_model(base, seed=seed, **model.demo.model_dump())
            storage.publish(base)
        out["base"] = str(base)
    else:
        out["base"] = str(resolve_model_path(model.path))  # a directory or a cached hub id
    log.info("base model %s (policy %s)", out["base"], policy_id(out["base"]))
    return out
