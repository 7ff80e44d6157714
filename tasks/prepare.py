"""Stage 0: the inputs. For the demo, make the data splits and the tiny base model; for a
user's model and data, check the files and point the pipeline at them."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpo_core.checkpoint import policy_id
from grpo_core.config import DataConfig, ModelConfig
from grpo_core.data import load_rows
from grpo_core.demo.task import make_splits
from grpo_core.io import write_jsonl
from tasks.common import logger
from tasks.workspace import Workspace


@task(name="prepare", cache_policy=NO_CACHE)
def prepare(data: DataConfig, model: ModelConfig, seed: int, ws: Workspace) -> dict[str, str]:
    """Returns paths: ``base`` checkpoint and ``sft``/``rl``/``dev``/``eval`` data."""
    log = logger(__name__)
    out: dict[str, str] = {}
    if data.source == "demo":
        d = data.demo
        splits = make_splits(seed, d.digits, d.n_sft, d.n_rl, d.n_dev, d.n_eval)
        for name in ("sft", "rl", "dev", "eval"):
            rows = getattr(splits, name)
            if rows:
                out[name] = str(write_jsonl(rows, ws.data(name)))
        log.info(
            "demo data: %s", {k: len(getattr(splits, k)) for k in ("sft", "rl", "dev", "eval")}
        )
    else:
        for name, path, cols in (
            ("sft", data.sft_path, ("prompt", "completion")),
            ("rl", data.rl_path, ("prompt",)),
            ("eval", data.eval_path, ("prompt",)),
        ):
            load_rows(path, required=cols)  # fail early, naming file and row
            out[name] = str(Path(path).resolve())
    if model.source == "demo":
        base = ws.checkpoint("base")
        if not (base / "config.json").exists():
            from grpo_core.demo.model import save_base_model

            save_base_model(base, seed=seed, **model.demo.model_dump())
        out["base"] = str(base)
    else:
        out["base"] = str(Path(model.path).resolve())
    log.info("base model %s (policy %s)", out["base"], policy_id(out["base"]))
    return out
