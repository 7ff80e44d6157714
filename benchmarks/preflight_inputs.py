"""The malformed inputs the pre-flight check must refuse: good and broken data, rollout and
scored files, checkpoints, config and reward files, dead tracking servers, read-only folders.
``write_inputs`` writes them all; benchmarks/preflight_cases.py runs ``grpo`` on them
(tests/pipeline/test_fail_fast.py, tests/tools/test_tool_preflight.py,
benchmarks/bench_preflight.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa

from grpo_core.contracts.io import write_parquet
from grpo_core.contracts.rollouts import META_KEY

ROOT = Path(__file__).resolve().parents[1]
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


def _data_files(d: Path) -> dict:
    """Data files each malformed in one way (and good ones beside them)."""
    p: dict = {}
    p["sft"] = _jsonl(d / "sft.jsonl", GOOD_SFT)
    p["rl"] = _jsonl(d / "rl.jsonl", GOOD_RL)
    p["eval"] = _jsonl(d / "eval.jsonl", GOOD_RL)
    p["rl_no_prompt"] = _jsonl(d / "rl_no_prompt.jsonl", [GOOD_RL[0], {"question": "3+3="}])
    (d / "rl_bad_json.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    p["rl_bad_json"] = str(d / "rl_bad_json.jsonl")
    p["rl_prompt_number"] = _jsonl(d / "rl_prompt_number.jsonl", [{"prompt": 12, "answer": "2"}])
    p["rl_chat_no_content"] = _jsonl(
        d / "rl_chat.jsonl", [{"prompt": [{"role": "user"}], "answer": "2"}]
    )
    p["sft_completion_list"] = _jsonl(
        d / "sft_bad.jsonl", [{"prompt": "1+1=", "completion": ["2"]}]
    )
    p["rl_huge_prompt"] = _jsonl(d / "rl_huge.jsonl", [{"prompt": "1" * 1_000_000, "answer": "2"}])
    p["rl_mixed_types"] = _jsonl(
        d / "rl_mixed.jsonl", [GOOD_RL[0], {"prompt": "2+2=", "answer": ["4"]}]
    )
    p["rl_no_answer"] = _jsonl(d / "rl_no_answer.jsonl", [{"prompt": "1+1="}])
    p["rl_reserved"] = _jsonl(d / "rl_reserved.jsonl", [{"prompt": "1+1=", "completions": "x"}])
    (d / "empty.jsonl").write_text("\n")
    p["empty"] = str(d / "empty.jsonl")
    (d / "rl.txt").write_text("prompt,answer\n1+1=,2\n")
    p["txt"] = str(d / "rl.txt")
    (d / "rl_trunc.parquet").write_bytes(b"PAR1" + b"\0" * 40)
    p["rl_trunc_parquet"] = str(d / "rl_trunc.parquet")
    return p


def _checkpoints(ck: Path, d: Path) -> dict:
    """Copies of checkpoint ``ck``, each broken in one way."""
    p: dict = {}
    weights = "model.safetensors"
    size = (ck / weights).stat().st_size
    p["ck_truncated"] = _checkpoint(
        ck, d / "ck_trunc", lambda c: os.truncate(c / weights, size // 2)
    )
    p["ck_no_config"] = _checkpoint(ck, d / "ck_noconf", lambda c: (c / "config.json").unlink())
    p["ck_bad_config"] = _checkpoint(
        ck, d / "ck_badconf", lambda c: (c / "config.json").write_text("{not json")
    )

    def garbage_header(c):
        data = bytearray((c / weights).read_bytes())
        data[:8] = (10**12).to_bytes(8, "little")
        (c / weights).write_bytes(bytes(data))

    p["ck_bad_header"] = _checkpoint(ck, d / "ck_badhdr", garbage_header)

    def no_tokenizer(c):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (c / f).unlink(missing_ok=True)

    p["ck_no_tokenizer"] = _checkpoint(ck, d / "ck_notok", no_tokenizer)
    p["ck_no_weights"] = _checkpoint(ck, d / "ck_noweights", lambda c: (c / weights).unlink())
    return p


def _run_files(ck: Path, d: Path) -> dict:
    """Rollout and scored Parquet files, good and broken, of ``ck``'s tokenizer."""
    p: dict = {}
    from tokenizers import Tokenizer

    from grpo_core.contracts.rollouts import tokenizer_fingerprint

    fp = tokenizer_fingerprint(Tokenizer.from_file(str(ck / "tokenizer.json")))
    p["rollouts"] = _parquet(d / "rollouts.parquet", _rollout_rows(), tokenizer=fp)
    p["rollouts_no_ids"] = _parquet(
        d / "rollouts_noids.parquet", _rollout_rows(), drop=["completion_ids"]
    )
    (d / "rollouts_trunc.parquet").write_bytes(Path(p["rollouts"]).read_bytes()[:300])
    p["rollouts_trunc"] = str(d / "rollouts_trunc.parquet")
    oov = _rollout_rows()
    oov[5]["completion_ids"] = [6, 99, 2]
    p["scored_oov"] = _parquet(d / "scored_oov.parquet", oov, scored=True, tokenizer=fp)
    p["scored_foreign"] = _parquet(
        d / "scored_foreign.parquet", _rollout_rows(), scored=True, tokenizer="0123456789abcdef"
    )
    p["scored_no_adv"] = _parquet(
        d / "scored_noadv.parquet", _rollout_rows(), scored=True, drop=["advantage"]
    )
    p.update(_bad_scored(d, fp))  # a NaN advantage, a null one, no rows
    (d / "dup.yaml").write_text("seed: 1\nrl:\n  iterations: 3\nseed: 2\n")
    p["dup_yaml"] = str(d / "dup.yaml")
    # a real rollout file of the tiny policy, and a policy whose tokenizer has the same
    # vocabulary size but two tokens swapped
    p["scored_real"] = _real_scored(ck, d)

    def swap_two_tokens(c):
        tok = json.loads((c / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[5:7]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (c / "tokenizer.json").write_text(json.dumps(tok))

    p["ck_swapped"] = _checkpoint(ck, d / "ck_swapped", swap_two_tokens)
    return p


def _config_files(d: Path) -> dict:
    """YAML, reward modules and tracking stores that cannot be used."""
    p: dict = {}
    (d / "bad.yaml").write_text("rl:\n  learning_rate: 1.0e-4\n   beta: 0.1\n")
    p["bad_yaml"] = str(d / "bad.yaml")
    (d / "syntax_err.py").write_text("def fn(prompts, completions, **kw)\n    return []\n")
    (d / "boom.py").write_text("raise RuntimeError('no GPU here')\n")
    (d / "sig.py").write_text("def fn(prompts, completions):\n    return [0.0] * len(prompts)\n")
    (d / "ok.py").write_text(
        "def fn(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n"
    )
    p["dir"] = str(d)

    (d / "notsqlite.db").write_text("hello")
    p["not_sqlite"] = str(d / "notsqlite.db")
    ro_db = d / "ro.db"
    ro_db.write_bytes(b"SQLite format 3\x00" + b"\0" * 84)
    ro_db.chmod(0o444)
    p["ro_db"] = str(ro_db)
    return p


@contextmanager
def write_inputs(d: Path, checkpoint: Path | str) -> Iterator[dict]:
    """Every malformed input, written under ``d`` once from the small real ``checkpoint``: a
    name -> path (or URL) map; ``work`` is the commands' working directory, ``dir`` the
    folder of the reward and config files. The refused port and the silent one stay valid,
    and the read-only folder read-only, until the block ends."""
    work = d / "work"
    work.mkdir()
    p = {"work": work, "ckpt": str(checkpoint)}
    p.update(_data_files(d))
    p.update(_checkpoints(Path(checkpoint), d))
    p.update(_run_files(Path(checkpoint), d))
    p.update(_config_files(d))
    ro_dir = d / "ro_dir"
    ro_dir.mkdir()
    ro_dir.chmod(0o555)
    p["ro_dir"] = str(ro_dir)

    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    p["refused_url"] = f"http://127.0.0.1:{refused.getsockname()[1]}"
    refused.close()  # nothing listens there any more
    hole = socket.socket()  # accepts connections (kernel backlog), never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    p["hole_url"] = f"http://127.0.0.1:{hole.getsockname()[1]}"
    try:
        yield p
    finally:
        hole.close()
        ro_dir.chmod(0o755)
