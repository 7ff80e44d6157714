"""Pre-flight: what can be checked before Prefect starts or any stage runs.

``grpo run`` and the stage commands (``grpo rollout|score|update|eval``) call
:func:`check_run` / :func:`check_stage` right after the config loads, so that a typo in a
reward name, a bad data row or a truncated weights file is reported in a second, as one
line naming the file, row, field or setting (a ``UserError``), instead of after SFT and a
rollout as a traceback. Nothing is written and no model is loaded: weights files are checked
from their safetensors header, token ids from the Parquet columns, a tokenizer from its
``tokenizer.json``.

What is checked:

- rewards: every name is a registered reward or an importable ``module:function`` /
  ``path/file.py:function`` with TRL's signature ``fn(prompts, completions, **kwargs)``;
  weights are finite; ``rejection_sampling.require`` names rewards that are computed; the
  eval section's reward names exist; the data has the columns the built-in rewards read;
  rewards that run model-written code (``code_tests``, ``code_runs``) have a working sandbox
- data files (``data.source: files``, ``--data``): they exist and parse, every row has a
  ``prompt`` (and SFT rows a ``completion``) of the right type, no prompt is longer than
  ``data.max_prompt_chars``, each column has one type (grpo_core/data.py)
- checkpoints (``model.path``, ``--policy``, ``--checkpoint``, the demo's base model when it
  exists): config.json parses, every ``*.safetensors`` header parses and the file is as long
  as its tensors need, the tokenizer files are there
- ``grpo update``: the scored file's token ids are inside the policy's vocabulary, and the
  tokenizer fingerprint recorded at rollout time matches the policy's
- the tracking store: an ``http(s)`` server answers ``GET /health`` within 5 s; a sqlite
  file is an SQLite database and it and its folder are writable
- output folders (``output_dir``, the run folder, ``--out``) are writable and have space
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from grpo_core.errors import UserError

HEALTH_TIMEOUT_S = 5.0
MIN_FREE_BYTES = 64 << 20
# columns that built-in rewards read from the data (they fail on every row without them)
REWARD_COLUMNS = {"accuracy": ("answer",), "math_verify": ("answer",)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SQLITE_MAGIC = b"SQLite format 3\x00"
# bytes per element of each safetensors dtype
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


# --------------------------------------------------------------------------- entry points


def check_run(cfg) -> None:
    """Everything ``grpo run`` needs, checked before Prefect starts."""
    check_outputs(cfg)
    check_rewards(cfg.rewards, overlong=bool(cfg.rl.overlong_buffer_length))
    check_reward_names(cfg)
    check_sandbox([*cfg.rewards, *_eval_rewards(cfg)[0]], cfg)
    missing = [k for k in cfg.rejection_sampling.require if k not in cfg.rewards]
    if missing:
        raise UserError(
            f"rejection_sampling.require: {', '.join(map(repr, missing))} not among the rewards "
            f"({', '.join(cfg.rewards)}), so no completion could pass; add it to rewards or "
            "remove it from rejection_sampling.require"
        )
    if cfg.data.source == "files":
        cap = cfg.data.max_prompt_chars
        check_data(cfg.data.sft_path, "data.sft_path", ("prompt", "completion"), cap)
        rl = check_data(cfg.data.rl_path, "data.rl_path", ("prompt",), cap)
        check_reward_columns(rl, cfg.data.rl_path, "data.rl_path", cfg.rewards, "rewards")
        ev = check_data(cfg.data.eval_path, "data.eval_path", ("prompt",), cap)
        check_reward_columns(ev, cfg.data.eval_path, "data.eval_path", *_eval_rewards(cfg))
    if cfg.model.source == "path":
        check_checkpoint(cfg.model.path, "model.path")
    else:
        base = Path(cfg.output_dir) / cfg.run_name / "checkpoints" / "base"
        if (base / "config.json").exists():
            check_checkpoint(base, "the demo's base model", fix=f"delete {base} to rebuild it")
    check_tracking(cfg.tracking.uri)


def check_stage(command: str, args, cfg) -> None:
    """Everything ``grpo <command>`` needs (its ``--policy``, ``--data``, ``--rollouts``,
    ``--scored``, ``--checkpoint`` and ``--out``), checked before Prefect starts."""
    from grpo_core.rollouts import ROLLOUT_COLUMNS

    check_outputs(cfg)
    cap = cfg.data.max_prompt_chars
    files = cfg.data.source == "files"
    out = getattr(args, "out", None)
    if command == "rollout":
        check_checkpoint(args.policy, "--policy")
        if args.iteration < 0:
            raise UserError(f"--iteration {args.iteration}: must be 0 or more")
        if args.data or files:
            field = "--data" if args.data else "data.rl_path"
            check_data(args.data or cfg.data.rl_path, field, ("prompt",), cap)
    elif command == "score":
        schema = check_parquet(args.rollouts, "--rollouts", ROLLOUT_COLUMNS)
        check_rewards(cfg.rewards, overlong=bool(cfg.rl.overlong_buffer_length))
        check_sandbox(cfg.rewards, cfg)
        columns = [{c: True for c in schema.names}]
        check_reward_columns(columns, args.rollouts, "--rollouts", cfg.rewards, "rewards")
        if out and Path(out).resolve() == Path(args.rollouts).resolve():
            raise UserError(f"--out {out}: scoring never rewrites the rollout file; choose another")
        if not out:
            check_writable_dir(Path(args.rollouts).resolve().parent, "--rollouts' folder")
    elif command == "update":
        required = {**ROLLOUT_COLUMNS, "reward": "", "advantage": ""}
        schema = check_parquet(args.scored, "--scored", required)
        config = check_checkpoint(args.policy, "--policy")
        check_token_ids(args.scored, schema, args.policy, config)
    elif command == "eval":
        check_checkpoint(args.checkpoint, "--checkpoint")
        check_reward_names(cfg)
        check_sandbox(_eval_rewards(cfg)[0], cfg)
        if args.data or files:
            field = "--data" if args.data else "data.eval_path"
            path = args.data or cfg.data.eval_path
            rows = check_data(path, field, ("prompt",), cap)
            check_reward_columns(rows, path, field, *_eval_rewards(cfg))
        if not out:
            check_writable_dir(Path(args.checkpoint).resolve().parent, "--checkpoint's folder")
    if out:
        check_writable_dir(Path(out).resolve().parent, f"--out {out}:")


# --------------------------------------------------------------------------- rewards


def load_reward(name: str, field: str):
    """The reward function ``name`` (registered, or a ``module:function`` spec), imported
    now; any failure is a ``UserError`` naming ``field``."""
    from grpo_core import rewards

    try:
        fn = rewards.get(name)
    except ValueError as e:  # unknown name (lists the valid ones), bad spec, missing file
        raise UserError(f"{field}: {_first_line(e)}") from None
    except ModuleNotFoundError as e:
        raise UserError(
            f"{field}: cannot import module {e.name!r} for reward {name!r}; check the spelling, "
            "install it, or add its folder to PYTHONPATH"
        ) from None
    except SyntaxError as e:
        raise UserError(
            f"{field}: {e.filename}, line {e.lineno}: syntax error in reward {name!r} ({e.msg})"
        ) from None
    except Exception as e:  # the module raised while importing
        raise UserError(
            f"{field}: importing reward {name!r} failed: {type(e).__name__}: {_first_line(e)}"
        ) from None
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables: nothing to check
        return fn
    positional_only = any(p.kind == p.POSITIONAL_ONLY and p.default is p.empty for p in params)
    if positional_only or not any(p.kind == p.VAR_KEYWORD for p in params):
        raise UserError(
            f"{field}: reward {name!r} must take fn(prompts, completions, **kwargs) (TRL's "
            "signature: the data's other columns come as keyword arguments)"
        )
    return fn


def check_rewards(weights: dict[str, float], *, overlong: bool = False) -> None:
    for name, weight in weights.items():
        if not math.isfinite(weight):
            raise UserError(f"rewards: the weight of {name!r} is {weight}; give a finite number")
        load_reward(name, "rewards")
    if overlong and "overlong_penalty" in weights:
        raise UserError(
            "rewards: 'overlong_penalty' is the name of rl.overlong_buffer_length's penalty; "
            "rename your reward function"
        )


def check_sandbox(names, cfg) -> None:
    """Rewards that run model-written code need a sandbox this machine can provide
    (``sandbox.isolation``); probed now (it runs a tiny program) instead of at scoring."""
    from grpo_core.rewards.code import EXECUTING

    if not any(n in EXECUTING for n in names):
        return
    from grpo_core.rewards.isolation import SandboxUnavailable, detect_isolation

    sandbox = getattr(cfg, "sandbox", None)
    try:
        detect_isolation(sandbox.isolation if sandbox is not None else None)
    except SandboxUnavailable as e:
        raise UserError(f"sandbox.isolation: {' '.join(str(e).split())}") from None


def _eval_rewards(cfg) -> tuple[list[str], str]:
    return [cfg.eval.accuracy_reward, cfg.eval.format_reward], "eval.accuracy_reward"


def check_reward_names(cfg) -> None:
    load_reward(cfg.eval.accuracy_reward, "eval.accuracy_reward")
    load_reward(cfg.eval.format_reward, "eval.format_reward")


def check_reward_columns(rows: list[dict], path, field: str, names, setting: str) -> None:
    """Every row has the columns the built-in rewards in ``names`` read."""
    for name in names:
        for col in REWARD_COLUMNS.get(name, ()):
            row = next((i for i, r in enumerate(rows) if col not in r), None)
            if row is not None:
                where = f"{path}, row {row}" if len(rows) > 1 else str(path)
                raise UserError(
                    f"{field}: {where}: no {col!r} column, which reward {name!r} reads; add it "
                    f"to the data or change {setting}"
                )


# --------------------------------------------------------------------------- data


def check_data(path, field: str, required: tuple[str, ...], max_prompt_chars: int) -> list[dict]:
    from grpo_core.data import load_rows

    if not path:
        raise UserError(f"{field}: not set")
    try:
        return load_rows(path, required=required, max_prompt_chars=max_prompt_chars)
    except UserError as e:
        raise UserError(f"{field}: {e}") from None


def check_parquet(path, field: str, required: dict):
    """The Parquet file's schema (footer only: nothing else is read); it must parse and
    have the contract's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{field} {path}: no such file")
    try:
        schema = pq.read_schema(p)
    except (pa.ArrowException, OSError) as e:
        raise UserError(
            f"{field} {path}: not a readable Parquet file ({_first_line(e)}); it may be "
            "truncated: write it again"
        ) from None
    missing = [c for c in required if "<" not in c and c != "group_idx" and c not in schema.names]
    if missing:
        raise UserError(
            f"{field} {path}: missing column(s) {', '.join(missing)} of the rollout contract "
            "(docs/architecture.md, 'Data contracts')"
        )
    return schema


# --------------------------------------------------------------------------- checkpoints


def check_safetensors(path: Path) -> None:
    """Parse the header (8-byte length + JSON) and check that the file holds every tensor it
    describes, without reading the tensors."""
    size = path.stat().st_size
    fix = "copy the file again or re-save the checkpoint"
    if size < 8:
        raise UserError(f"{path}: truncated ({size} bytes, not even a header); {fix}")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise UserError(
                f"{path}: header length {n:,} does not fit in the file ({size:,} bytes): "
                f"truncated or not a safetensors file; {fix}"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"{path}: the safetensors header is not valid JSON; {fix}") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: the safetensors header is not a JSON object; {fix}")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = info["data_offsets"]
            shape, dtype = info["shape"], info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise UserError(
                f"{path}: tensor {name!r} has a malformed header entry; {fix}"
            ) from None
        width = DTYPE_BYTES.get(dtype)
        if width is not None and stop - begin != math.prod(shape) * width:
            raise UserError(
                f"{path}: tensor {name!r} ({dtype} {shape}) spans {stop - begin} bytes, not "
                f"{math.prod(shape) * width}; {fix}"
            )
        end = max(end, stop)
    if 8 + n + end > size:
        raise UserError(
            f"{path}: truncated: its header describes {8 + n + end:,} bytes, the file has "
            f"{size:,}; {fix}"
        )


def check_checkpoint(path, field: str, fix: str = "") -> dict:
    """A ``save_pretrained`` directory the pipeline can load; returns its config.json."""
    p = Path(path) if path else None
    hint = f"; {fix}" if fix else ""
    if p is None or not p.exists():
        raise UserError(f"{field} {path}: no such folder")
    if not p.is_dir():
        raise UserError(f"{field} {path}: not a folder (expected a save_pretrained directory)")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise UserError(
            f"{field} {path}: not a checkpoint: config.json missing (expected a "
            f"save_pretrained directory){hint}"
        )
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{cfg_file}: not valid JSON ({e}){hint}") from None
    if not isinstance(config, dict):
        raise UserError(f"{cfg_file}: expected a JSON object{hint}")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UserError(f"{index}: not a valid safetensors index{hint}") from None
        absent = sorted(s for s in shards if not (p / s).is_file())
        if absent:
            raise UserError(f"{field} {path}: weight shard(s) missing: {', '.join(absent)}{hint}")
    weights = sorted(p.glob("*.safetensors"))
    if not weights:
        raise UserError(
            f"{field} {path}: no *.safetensors weights; save the model with "
            f"save_pretrained(safe_serialization=True){hint}"
        )
    for w in weights:
        try:
            check_safetensors(w)
        except UserError as e:
            raise UserError(f"{field}: {e}{hint}") from None
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"{field} {path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the "
            f"tokenizer into the checkpoint too (tokenizer.save_pretrained){hint}"
        )
    return config


def check_token_ids(scored, schema, policy, config: dict) -> None:
    """The scored file's token ids index the policy's embedding, and were made by the
    policy's tokenizer (the fingerprint recorded at rollout time, when there is one)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from grpo_core.rollouts import META_KEY, tokenizer_fingerprint

    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if isinstance(vocab, int):
        table = pq.read_table(scored, columns=["prompt_ids", "completion_ids"])
        for col in ("prompt_ids", "completion_ids"):
            flat = pc.list_flatten(table[col])
            if len(flat) == 0:
                continue
            lo, hi = pc.min(flat).as_py(), pc.max(flat).as_py()
            if lo is not None and (lo < 0 or hi >= vocab):
                for row, ids in enumerate(table[col].to_pylist()):
                    bad = next((t for t in ids or () if t < 0 or t >= vocab), None)
                    if bad is not None:
                        raise UserError(
                            f"--scored {scored}, row {row}, field {col!r}: token id {bad} is "
                            f"outside --policy {policy}'s vocabulary (vocab_size {vocab}); the "
                            "file was written with another tokenizer: sample and score rollouts "
                            "with this policy"
                        )
    try:
        recorded = json.loads((schema.metadata or {}).get(META_KEY, b"{}")).get("tokenizer")
    except (json.JSONDecodeError, AttributeError):
        recorded = None
    tok_file = Path(policy) / "tokenizer.json"
    if recorded and tok_file.is_file():
        from tokenizers import Tokenizer

        try:
            mine = tokenizer_fingerprint(Tokenizer.from_file(str(tok_file)))
        except Exception as e:  # a tokenizer.json the tokenizers library cannot read
            raise UserError(f"{tok_file}: cannot be read ({_first_line(e)})") from None
        if recorded != mine:
            raise UserError(
                f"--scored {scored}: its token ids come from another tokenizer (fingerprint "
                f"{recorded}) than --policy {policy}'s ({mine}); sample and score rollouts with "
                "this policy, or update the policy that wrote them"
            )


# --------------------------------------------------------------------------- tracking


def check_tracking(uri: str) -> None:
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        probe_server(uri)
    elif parsed.scheme == "sqlite":
        check_sqlite(uri)
    elif parsed.scheme in ("", "file"):  # a local file store (mlruns folder)
        check_writable_dir(Path(parsed.path if parsed.scheme else uri), "tracking.uri")


def probe_server(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """``GET <uri>/health`` must answer 200 within ``timeout`` seconds (one try)."""
    url = uri.rstrip("/") + "/health"
    fix = "start it (infra/start-servers.sh) or set tracking.uri=sqlite:///mlflow.db"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            if r.status == 200:
                return
            reason = f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        reason = f"HTTP {e.code} from {url}: not an MLflow server?"
    except urllib.error.URLError as e:
        reason = str(e.reason)
    except (TimeoutError, OSError) as e:
        reason = str(e) or type(e).__name__
    if "timed out" in reason or reason == "TimeoutError":
        reason = f"no answer within {timeout:g} s"
    raise UserError(f"tracking.uri {uri}: no MLflow server answers ({reason}); {fix}")


def check_sqlite(uri: str) -> None:
    rest = uri[len("sqlite://") :].split("?", 1)[0]
    if not rest or rest in ("/", "/:memory:"):
        return
    path = Path(rest[1:] if rest.startswith("/") else rest)  # sqlite:///rel.db, sqlite:////abs
    fix = "or set tracking.uri to another store"
    if path.exists():
        if not path.is_file():
            raise UserError(f"tracking.uri {uri}: {path} is not a file")
        with open(path, "rb") as f:
            head = f.read(16)
        if head and head != SQLITE_MAGIC:
            raise UserError(f"tracking.uri {uri}: {path} is not an SQLite database; {fix}")
        if not _writable(path):
            raise UserError(
                f"tracking.uri {uri}: the MLflow database {path} is read-only; make it "
                f"writable {fix}"
            )
    folder = path.resolve().parent
    if not folder.is_dir():
        raise UserError(f"tracking.uri {uri}: folder {folder} does not exist; create it {fix}")
    check_writable_dir(folder, f"tracking.uri {uri}: the database's folder")


# --------------------------------------------------------------------------- outputs


def _writable(path: Path) -> bool:
    """Writable by this process, and not marked read-only (no write bit at all: also for
    root, who may write anyway)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    flags = os.W_OK | (os.X_OK if stat.S_ISDIR(mode) else 0)
    return os.access(path, flags) and bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def check_writable_dir(path: Path, what: str) -> None:
    """``path`` (which may not exist yet) can be created and written: its nearest existing
    ancestor is a writable folder with some free space."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    label = what if what.endswith(":") else f"{what} {path}:"
    if not existing.is_dir():
        raise UserError(f"{label} {existing} is a file, not a folder; choose another path")
    if not _writable(existing):
        raise UserError(
            f"{label} {existing} is read-only; make it writable or choose a writable folder"
        )
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        raise UserError(
            f"{label} only {free >> 20} MiB free on its disk; free some space or choose a "
            "folder on another disk"
        )


def check_outputs(cfg) -> None:
    name = cfg.run_name
    if not name or "/" in name or os.sep in name or name in (".", ".."):
        raise UserError(f"run_name {name!r}: must be one folder name, e.g. run_name=demo")
    check_writable_dir(Path(cfg.output_dir), "output_dir")
    run_dir = Path(cfg.output_dir) / name
    if run_dir.exists():
        check_writable_dir(run_dir, "the run folder")


def _first_line(e: Any) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
