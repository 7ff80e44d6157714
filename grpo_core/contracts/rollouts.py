"""The rollout and scored Parquet contracts (docs/architecture.md, "Data contracts").

Rollouts: one row per completion. Scored: the rollout rows plus one ``reward_<fn>`` and
``error_<fn>`` column per reward function, ``reward`` (weighted sum) and ``advantage``.
Scoring writes a new file; the rollout file is never rewritten.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from grpo_core.contracts.text import decode_completion, row_prompt_text

if TYPE_CHECKING:
    from grpo_core.engines.generation import Sample

SCHEMA_VERSION = "2"  # 2: group_idx
META_KEY = b"grpo_pipeline"

ROLLOUT_COLUMNS = {
    "prompt_id": "stable hash of the prompt (same prompt, same id, across runs)",
    "group_idx": "index of the drawn prompt within its iteration: rows of one group share it "
    "(the same prompt drawn twice in one iteration makes two groups)",
    "sample_idx": "index of this completion within its prompt's group (0..num_generations-1)",
    "prompt": "the prompt as given in the data (text or chat messages)",
    "prompt_text": "the prompt after the chat template, as the model saw it",
    "completion": "decoded completion text (special tokens removed)",
    "prompt_ids": "prompt token ids",
    "completion_ids": "completion token ids (ends with EOS when finish_reason is 'stop')",
    "completion_logprobs": "sampling policy's log-probability of each completion token",
    "completion_length": "number of completion tokens",
    "finish_reason": "'stop' (EOS or a stop string) or 'length' (hit max_completion_length)",
    "policy_id": "content hash of the checkpoint that sampled the row",
    "iteration": "RL iteration (generation batch) that produced the row",
}
# Read without them: files from before schema 2 (or from other tools) group by prompt_id;
# the episode columns are written only when some episode has more than the model's one turn.
EPISODE_COLUMNS = {
    "loss_mask": "per completion token: 1 the model wrote it, 0 an environment added it (no "
    "loss); absent: every token the model's",
    "turns": "the episode's turns, each {role, start, end, text, error, seconds, stalled}: "
    "the token span in the completion, its text, a tool call's error (null: it ran) and wall "
    "time, and the seconds the turn loop stood still waiting for that call with nothing to "
    "sample; absent: one assistant turn",
    "tool_calls": "tool calls in the episode (a turn with several JSON calls counts each)",
    "tool_errors": "tool calls that failed (raised, timed out, were killed, were not run)",
    "tool_time_s": "the episode's tool calls' wall time",
}
# Written when the environment's episodes have a reward() (docs/tools.md): what the
# ``environment`` reward function pays, recorded so a re-score needs no environment
ENV_REWARD_COLUMNS = {
    "env_reward": "the environment's own reward for the episode (null: none, or it failed)",
    "env_reward_error": "the error of the episode's reward() (null: none)",
}
# Written when the sampler processed its distribution (top_p < 1, top_k > 0, min_p > 0,
# repetition_penalty != 1) and the engine gives the policy's own log-probs (the hf engine):
# what a behaviour weight divides by. Absent: ``completion_logprobs`` are that already.
POLICY_LOGPROBS = "completion_policy_logprobs"
POLICY_LOGPROB_COLUMNS = {
    POLICY_LOGPROBS: "the sampling policy's log-probability of each completion token under "
    "its temperature-scaled softmax, before top-p, top-k, min-p and repetition penalty (the "
    "trainer's recomputed quantity; 0 on tokens an environment added); absent: the sampling "
    "distribution was not processed and completion_logprobs are these",
}
# Written when an environment's reset() added to some episode's prompt (docs/tools.md); the
# rows' prompt_text and prompt_ids are then each episode's own, what its model saw
EPISODE_PROMPT = "episode_prompt"
EPISODE_PROMPT_COLUMNS = {
    EPISODE_PROMPT: "the prompt the episode's model saw, in the data's form (text or chat "
    "messages): the data's prompt with what the environment's reset() added; reward "
    "functions get it as their prompts",
}
OPTIONAL_COLUMNS = (
    "group_idx",
    *EPISODE_COLUMNS,
    *ENV_REWARD_COLUMNS,
    *POLICY_LOGPROB_COLUMNS,
    *EPISODE_PROMPT_COLUMNS,
)
EMPTY_TURN = {"role": "assistant", "start": 0, "end": 0, "text": "", "error": None, "seconds": 0.0,
              "stalled": 0.0, "calls": 0, "failed": 0}  # fmt: skip


def turn_calls(turn: dict) -> tuple[int, int]:
    """(tool calls, failed calls) a turn answers: its ``calls``/``failed``, or, in a file
    written before they were recorded, one call per tool turn, failed when it has an
    error."""
    if turn.get("role") != "tool":
        return 0, 0
    if turn.get("calls") is None:
        return 1, int(turn.get("error") is not None)
    return int(turn["calls"]), int(turn.get("failed") or 0)


SCORED_COLUMNS = {
    "reward_<fn>": "score of reward function <fn> (null: not applicable or failed)",
    "error_<fn>": "error raised by reward function <fn> for this row (null: none)",
    "reward": "weighted sum of the reward functions (TRL's nansum)",
    "advantage": "group-normalised advantage used by the GRPO update",
}


def prompt_hash(prompt: Any) -> str:
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


def env_reward_record(sample: Sample) -> dict:
    """The sample's ``env_reward`` and ``env_reward_error`` (:data:`ENV_REWARD_COLUMNS`)."""
    env = sample.env or {}
    return {"env_reward": env.get("reward"), "env_reward_error": env.get("error")}


def env_reward_columns(samples: list[Sample]) -> dict[str, list]:
    """The samples' :data:`ENV_REWARD_COLUMNS` as reward-function columns, when some episode's
    environment has a ``reward()`` (else none): what the ``environment`` reward pays, for the
    evals as for the rollouts."""
    if not any(s.env is not None for s in samples):
        return {}
    records = [env_reward_record(s) for s in samples]
    return {k: [r[k] for r in records] for k in ENV_REWARD_COLUMNS}


def tokenizer_fingerprint(tokenizer) -> str:
    """16 hex digits of a sha256 over the tokenizer's vocabulary (token -> id, the model's
    vocabulary without added tokens), recorded as ``tokenizer`` in a rollout file's metadata
    so that ``grpo update`` can refuse token ids from another tokenizer. A transformers
    tokenizer and a ``tokenizers.Tokenizer`` read from the same ``tokenizer.json`` give the
    same fingerprint."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
    try:
        vocab = backend.get_vocab(with_added_tokens=False)
    except TypeError:  # a Python ("slow") tokenizer
        vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def rollout_table(
    rows: list[dict],
    prompt_ids: list[list[int]],
    samples: list[Sample],
    tokenizer,
    *,
    policy_id: str,
    iteration: int,
    metadata: dict | None = None,
) -> pa.Table:
    """Rows of the rollout contract; ``rows[i]``'s other columns are passed through. The
    metadata records the tokenizer's fingerprint (:func:`tokenizer_fingerprint`)."""
    records = []
    # once per prompt, not once per completion (the chat template is rendered in Python)
    hashes = {i: prompt_hash(rows[i]["prompt"]) for i in {s.prompt_index for s in samples}}
    texts = {i: row_prompt_text(tokenizer, rows[i]) for i in hashes}
    # multi-turn episodes (grpo_core/engines/turns.py): every row gets the episode columns
    episodes = any(s.loss_mask is not None or s.turns is not None for s in samples)
    env_rewards = any(s.env is not None for s in samples)
    policy = any(s.policy_logprobs is not None for s in samples)
    opened = any(s.prompt is not None for s in samples)  # a reset() added to a prompt
    for s in samples:
        row = rows[s.prompt_index]
        rec = {
            "prompt_id": hashes[s.prompt_index],
            "group_idx": s.prompt_index,
            "sample_idx": s.sample_index,
            "prompt": row["prompt"],
            "prompt_text": texts[s.prompt_index],
            "completion": decode_completion(tokenizer, s.completion_ids),
            "prompt_ids": prompt_ids[s.prompt_index] if s.prompt_ids is None else s.prompt_ids,
            "completion_ids": s.completion_ids,
            "completion_logprobs": s.logprobs,
            "completion_length": len(s.completion_ids),
            "finish_reason": s.finish_reason,
            "policy_id": policy_id,
            "iteration": iteration,
        }
        if episodes:
            n = len(s.completion_ids)
            turns = s.turns or [{"role": "assistant", "start": 0, "end": n}]
            tools = [t for t in turns if t["role"] == "tool"]
            rec["loss_mask"] = s.loss_mask or [1] * n
            rec["turns"] = [{**EMPTY_TURN, **t} for t in turns]
            rec["tool_calls"] = sum(turn_calls(t)[0] for t in tools)
            rec["tool_errors"] = sum(turn_calls(t)[1] for t in tools)
            rec["tool_time_s"] = float(sum(t.get("seconds") or 0.0 for t in tools))
        if opened:
            rec[EPISODE_PROMPT] = row["prompt"] if s.prompt is None else s.prompt
            if s.prompt is not None:
                rec["prompt_text"] = row_prompt_text(tokenizer, {**row, "prompt": s.prompt})
        if policy:
            rec[POLICY_LOGPROBS] = s.logprobs if s.policy_logprobs is None else s.policy_logprobs
        if env_rewards:
            rec.update(env_reward_record(s))
        for k, v in row.items():
            if k not in rec and k != "completion":
                rec[k] = v
        records.append(rec)
    table = pa.Table.from_pylist(records)
    meta = {"kind": "rollouts", "tokenizer": tokenizer_fingerprint(tokenizer)}
    return with_metadata(table, {**meta, **(metadata or {})})


def with_metadata(table: pa.Table, meta: dict) -> pa.Table:
    merged = {**read_metadata_of(table), "schema_version": SCHEMA_VERSION, **meta}
    existing = dict(table.schema.metadata or {})
    existing[META_KEY] = json.dumps(merged, default=str).encode()
    return table.replace_schema_metadata(existing)


def read_metadata_of(table: pa.Table) -> dict:
    raw = (table.schema.metadata or {}).get(META_KEY)
    return json.loads(raw) if raw else {}


def read_table(path: str | Path, required: dict[str, str] | None = None) -> pa.Table:
    """Read a Parquet file and check that the contract's columns are there."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such Parquet file")
    table = pq.read_table(path)
    required = ROLLOUT_COLUMNS if required is None else required
    missing = [
        c
        for c in required
        if "<" not in c and c not in OPTIONAL_COLUMNS and c not in table.column_names
    ]
    if missing:
        raise ValueError(
            f"{path}: missing column(s) {', '.join(missing)}; expected the rollout contract "
            f"columns {', '.join(c for c in required if '<' not in c)}"
        )
    return table


def read_rollouts(path: str | Path) -> pa.Table:
    return read_table(path, ROLLOUT_COLUMNS)


def read_scored(path: str | Path) -> pa.Table:
    return read_table(path, {**ROLLOUT_COLUMNS, "reward": "", "advantage": ""})


def scored_table(
    rollouts: pa.Table,
    per_function: dict[str, list],
    errors: dict[str, list],
    total: list[float],
    advantages: list[float],
    *,
    metadata: dict | None = None,
) -> pa.Table:
    """Rollout rows + reward columns + advantage (the rollout table itself is untouched)."""
    table = rollouts
    for name, scores in per_function.items():
        table = table.append_column(f"reward_{name}", pa.array(scores, type=pa.float64()))
        table = table.append_column(f"error_{name}", pa.array(errors[name], type=pa.string()))
    table = table.append_column("reward", pa.array(total, type=pa.float64()))
    table = table.append_column("advantage", pa.array(advantages, type=pa.float32()))
    return with_metadata(table, {"kind": "scored", **(metadata or {})})


def group_ids(table: pa.Table, source: str | Path = "table") -> list[int]:
    """Integer group id per row: one group per ``(iteration, group_idx)``, numbered in order
    of first appearance.

    Files written before ``group_idx`` existed (or by other tools) are grouped by
    ``(iteration, prompt_id)``, which is only right when no prompt was drawn twice in one
    iteration: a repeated ``sample_idx`` within such a group means it was, and is an error.
    """
    names = table.column_names
    if "group_idx" in names:
        keys = zip(
            table.column("iteration").to_pylist(),
            table.column("group_idx").to_pylist(),
            strict=True,
        )
        ids: dict[tuple, int] = {}
        return [ids.setdefault(k, len(ids)) for k in keys]
    keys = list(
        zip(
            table.column("iteration").to_pylist(),
            table.column("prompt_id").to_pylist(),
            strict=True,
        )
    )
    ids = {}
    out = [ids.setdefault(k, len(ids)) for k in keys]
    seen: set[tuple[int, int]] = set()
    for row, (gid, sample) in enumerate(
        zip(out, table.column("sample_idx").to_pylist(), strict=True)
    ):
        if (gid, sample) in seen:
            iteration, prompt_id = keys[row]
            raise ValueError(
                f"{source}: row {row} repeats sample_idx {sample} of prompt_id {prompt_id} in "
                f"iteration {iteration}: the prompt was drawn twice, and without a 'group_idx' "
                "column (one value per drawn prompt) its two groups cannot be told apart"
            )
        seen.add((gid, sample))
    return out
