"""The inputs of tests/pipeline/test_fail_fast.py: good and broken data, rollout and scored
files, checkpoints, from which the test module's ``inputs`` fixture builds its cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa

from grpo_core.contracts.io import write_parquet
from grpo_core.contracts.rollouts import META_KEY

ROOT = Path(__file__).resolve().parents[2]
GOOD_RL = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
GOOD_SFT = [{"prompt": "1+1=", "completion": "<answer>2</answer>"}]


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rollout_rows(n_groups=2, n=4, ids=(6, 7, 2)):
    return [
        {
            "prompt_id": f"p{g}",
            "group_idx": g,
            "sample_idx": s,
            "prompt": f"{g}+1=",
            "prompt_text": f"{g}+1=",
            "completion": "<answer>1</answer>",
            "prompt_ids": [3, 4, 5],
            "completion_ids": list(ids),
            "completion_logprobs": [-1.0] * len(ids),
            "completion_length": len(ids),
            "finish_reason": "stop",
            "policy_id": "x",
            "iteration": 0,
            "answer": str(g + 1),
        }
        for g in range(n_groups)
        for s in range(n)
    ]


def _parquet(path: Path, rows, *, scored=False, tokenizer=None, drop=()) -> str:
    table = pa.Table.from_pylist(rows)
    if scored:
        table = table.append_column("reward", pa.array([1.0] * len(rows)))
        table = table.append_column("advantage", pa.array([0.5] * len(rows), pa.float32()))
    table = table.drop(list(drop))
    meta = {"schema_version": "2", "kind": "scored" if scored else "rollouts"}
    if tokenizer:
        meta["tokenizer"] = tokenizer
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    write_parquet(table, path)
    return str(path)


def _checkpoint(src: Path, dst: Path, edit=None) -> str:
    shutil.copytree(src, dst)
    if edit:
        edit(dst)
    return str(dst)


def _real_scored(ck: Path, d: Path) -> str:
    """Rollouts sampled from ``ck`` (metadata records its tokenizer), with reward/advantage."""
    import pyarrow.parquet as pq

    from tasks.rollout import sample_rollouts

    rows = [{"prompt": "12+34=", "answer": "46"}]
    out = sample_rollouts(
        str(ck), rows, str(d / "real_rollouts.parquet"), num_generations=2, temperature=1.0,
        max_completion_length=4, iteration=0, seed=0,
    )  # fmt: skip
    table = pq.read_table(out.path)
    table = table.append_column("reward", pa.array([1.0, 0.0]))
    table = table.append_column("advantage", pa.array([0.7, -0.7], pa.float32()))
    write_parquet(table, d / "real_scored.parquet")
    return str(d / "real_scored.parquet")


def _bad_scored(d: Path, fingerprint: str) -> dict[str, str]:
    """Scored files ``grpo update`` must refuse: row 3's advantage NaN (``scored_nan``) or
    null (``scored_null``), and every column but no row (``scored_empty``)."""
    import pyarrow.parquet as pq

    out = {}
    for name, value in (("nan", float("nan")), ("null", None)):
        path = Path(_parquet(d / f"scored_{name}.parquet", _rollout_rows(), scored=True,
                             tokenizer=fingerprint))  # fmt: skip
        table = pq.read_table(path)
        adv = table.column("advantage").to_pylist()
        adv[3] = value
        i = table.schema.get_field_index("advantage")
        table = table.set_column(i, table.schema.field(i), pa.array(adv, pa.float32()))
        pq.write_table(table, path)
        out[f"scored_{name}"] = str(path)
    pq.write_table(pq.read_table(out["scored_nan"]).slice(0, 0), d / "scored_empty.parquet")
    out["scored_empty"] = str(d / "scored_empty.parquet")
    return out
