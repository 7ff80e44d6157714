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
- data files (``data.source: files``, ``--data``): they exist and parse, the data section's
  column mapping / template / preset applies to every row (not to ``--data``), every row has a
  ``prompt`` (and SFT rows a ``completion``) of the right type, no prompt is longer than
  ``data.max_prompt_chars``, each column has one type (grpo_core/contracts/prompts.py)
- checkpoints (``model.path``, ``--policy``, ``--checkpoint``, the demo's base model when it
  exists): config.json parses, every ``*.safetensors`` header parses and the file is as long
  as its tensors need, the tokenizer files are there
- ``grpo update``: the scored file's token ids are inside the policy's vocabulary, and the
  tokenizer fingerprint recorded at rollout time matches the policy's
- lengths: every ``max_completion_length`` is below the model's positions, and every prompt
  of the data files fits with it (tokenised with the model's tokenizer; grpo_core/engines/context.py)
- the tracking store: an ``http(s)`` server answers ``GET /health`` within 5 s and, when it
  asks for a password, gets the right one (``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``); a
  sqlite file is an SQLite database and it and its folder are writable
- a Prefect server in ``PREFECT_API_URL`` that asks for a password gets the right one
  (``PREFECT_API_AUTH_STRING``)
- output folders (``output_dir``, the run folder, ``--out``) are writable and have space
- the rollout's engine and environment (``tools``): vLLM importable for ``engine: vllm``;
  ``rollout.tools`` one known tool or importable ``module:function``, ``max_turns`` >= 2,
  distinct markers that are in the model's vocabulary, a tool memory cap the machine has
- dtypes: no bf16/fp16 setting (``model.dtype``, the checkpoint's when ``auto``, a section's
  ``bf16``/``fp16``) on a CPU that would emulate it 25-70x slower than float32 (``hardware``)

Layout: this module holds the entry points; the checks live in ``rewards``, ``data``
(data files, Parquet schemas, token ids), ``checkpoints``, ``outputs`` (tracking store,
output folders) and ``tools`` (engine, environment), and are re-exported here.
"""

from __future__ import annotations

from pathlib import Path

from flows.preflight.checkpoints import check_checkpoint, check_safetensors
from flows.preflight.context import check_batch_fits, check_context
from flows.preflight.data import check_data, check_parquet, check_scored_rows, check_token_ids
from flows.preflight.hardware import check_cpu_dtypes
from flows.preflight.outputs import (
    check_outputs,
    check_prefect_api,
    check_sqlite,
    check_tracking,
    check_writable_dir,
    probe_server,
)
from flows.preflight.rewards import (
    check_advantage_estimators,
    check_reward_columns,
    check_reward_names,
    check_rewards,
    check_sandbox,
    eval_rewards,
    load_reward,
)
from flows.preflight.tools import check_engine, check_tools
from grpo_core.errors import UserError

__all__ = [
    "check_advantage_estimators",
    "check_checkpoint",
    "check_cpu_dtypes",
    "check_batch_fits",
    "check_context",
    "check_data",
    "check_outputs",
    "check_parquet",
    "check_scored_rows",
    "check_reward_columns",
    "check_reward_names",
    "check_rewards",
    "check_run",
    "check_safetensors",
    "check_sandbox",
    "check_sqlite",
    "check_stage",
    "check_token_ids",
    "check_prefect_api",
    "check_tracking",
    "check_writable_dir",
    "check_engine",
    "check_tools",
    "eval_rewards",
    "load_reward",
    "probe_server",
]


def check_run(cfg) -> None:
    """Everything ``grpo run`` needs, checked before Prefect starts."""
    check_outputs(cfg)
    check_rewards(cfg.rewards, overlong=bool(cfg.rl.overlong_buffer_length))
    check_advantage_estimators(cfg)
    check_reward_names(cfg)
    check_sandbox([*cfg.rewards, *eval_rewards(cfg)[0]], cfg)
    missing = [k for k in cfg.rejection_sampling.require if k not in cfg.rewards]
    if missing:
        raise UserError(
            f"rejection_sampling.require: {', '.join(map(repr, missing))} not among the rewards "
            f"({', '.join(cfg.rewards)}), so no completion could pass; add it to rewards or "
            "remove it from rejection_sampling.require"
        )
    prompts: dict = {}
    if cfg.data.source == "files":
        cap, m = cfg.data.max_prompt_chars, cfg.data.mapping()
        check_data(cfg.data.sft_path, "data.sft_path", ("prompt", "completion"), cap, m)
        rl = check_data(cfg.data.rl_path, "data.rl_path", ("prompt",), cap, m)
        check_reward_columns(rl, cfg.data.rl_path, "data.rl_path", cfg.rewards, "rewards")
        prompts = {"data.rl_path": (cfg.data.rl_path, rl)}
        if cfg.data.dev_path:
            dev = check_data(cfg.data.dev_path, "data.dev_path", ("prompt",), cap, m)
            prompts["data.dev_path"] = (cfg.data.dev_path, dev)
        ev = check_data(cfg.data.eval_path, "data.eval_path", ("prompt",), cap, m)
        check_reward_columns(ev, cfg.data.eval_path, "data.eval_path", *eval_rewards(cfg))
        prompts["data.eval_path"] = (cfg.data.eval_path, ev)
    if cfg.model.source == "path":
        from grpo_core.training.checkpoint import resolve_model_path

        check_checkpoint(resolve_model_path(cfg.model.path), "model.path")
    else:
        base = Path(cfg.output_dir) / cfg.run_name / "checkpoints" / "base"
        if (base / "config.json").exists():
            check_checkpoint(base, "the demo's base model", fix=f"delete {base} to rebuild it")
    check_cpu_dtypes(cfg)
    check_context(cfg, prompts)
    check_engine(cfg)
    check_tools(cfg)
    check_batch_fits(cfg)
    check_tracking(cfg.tracking.uri)
    check_prefect_api()


def _tokenizer_of(checkpoint):
    def load():
        from grpo_core.training.tokenizers import saved_tokenizer

        return saved_tokenizer(checkpoint, local_files_only=True)

    return load


def check_stage(command: str, args, cfg) -> None:
    """Everything ``grpo <command>`` needs (its ``--policy``, ``--data``, ``--rollouts``,
    ``--scored``, ``--checkpoint`` and ``--out``), checked before Prefect starts."""
    from grpo_core.contracts.rollouts import ROLLOUT_COLUMNS

    check_outputs(cfg)
    if command != "score":  # the others train or sample with the model's dtype
        check_cpu_dtypes(cfg)
    cap = cfg.data.max_prompt_chars
    files = cfg.data.source == "files"
    out = getattr(args, "out", None)
    if command in ("rollout", "eval"):  # they sample: the engine and the environment
        check_engine(cfg)
        check_tools(cfg, tokenizer=_tokenizer_of(args.policy if command == "rollout" else
                                                 args.checkpoint))  # fmt: skip
    if command == "rollout":
        check_checkpoint(args.policy, "--policy")
        if args.iteration < 0:
            raise UserError(f"--iteration {args.iteration}: must be 0 or more")
        if args.data or files:
            field = "--data" if args.data else "data.rl_path"
            m = None if args.data else cfg.data.mapping()  # --data: rows in the pipeline's format
            check_data(args.data or cfg.data.rl_path, field, ("prompt",), cap, m)
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
        check_scored_rows(args.scored)
        config = check_checkpoint(args.policy, "--policy")
        check_token_ids(args.scored, schema, args.policy, config)
    elif command == "eval":
        check_checkpoint(args.checkpoint, "--checkpoint")
        check_reward_names(cfg)
        check_sandbox(eval_rewards(cfg)[0], cfg)
        if args.data or files:
            field = "--data" if args.data else "data.eval_path"
            path = args.data or cfg.data.eval_path
            m = None if args.data else cfg.data.mapping()
            rows = check_data(path, field, ("prompt",), cap, m)
            check_reward_columns(rows, path, field, *eval_rewards(cfg))
        if not out:
            check_writable_dir(Path(args.checkpoint).resolve().parent, "--checkpoint's folder")
    if out:
        check_writable_dir(Path(out).resolve().parent, f"--out {out}:")
    check_prefect_api()
