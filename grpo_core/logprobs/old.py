"""Where the update's old log-probs come from: the rollout engine's stored sampling log-probs,
or a no-grad forward of the policy before the first optimizer step (``rl.old_logprobs``).

The ``hf`` engine samples with the very module the update trains (the warm policy), at the
same temperature, and records ``log_softmax(logits / temperature)`` of each sampled token in
float32. When nothing else differs, those are the old log-probs the recompute pass would give
(they agree to about 5e-7 at float32: KV-cache versus full-sequence attention), so the pass
can be skipped. They are *not* the same when any of these holds, and ``auto`` then recomputes:

- another engine (vLLM has its own kernels), or rows sampled by another policy than the one
  being updated (their ``policy_id``), or a file that does not say how it was sampled;
- the sampler's distribution was processed (``top_p < 1``, ``top_k > 0``, ``min_p > 0``,
  ``repetition_penalty != 1``) or its temperature is not the update's;
- reduced precision: a model not in float32 (when sampled or now), bf16/fp16 autocast in the
  update, or 4-bit weights;
- dropout on in the update (its forward is then random, the sampler's is not);
- the engine correction (``vllm_importance_sampling_correction``) is on: its ratio needs the
  trainer's own log-probs.

Pure bookkeeping on plain values: no torch, no config objects.
"""

from __future__ import annotations

OLD_LOGPROBS_MODES = ("auto", "recompute", "sampler")
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def old_logprobs_source(
    mode: str,
    *,
    file_meta: dict,
    policy_ids: set[str],
    policy_id: str,
    temperature: float,
    model_dtype: str,
    bf16: bool = False,
    fp16: bool = False,
    quantized: bool = False,
    disable_dropout: bool = True,
    engine_correction: bool = False,
) -> tuple[str, str]:
    """``("sampler" | "recompute", reason)`` for ``mode`` (``auto``, ``recompute`` or
    ``sampler``).

    ``file_meta``: the scored file's metadata (``engine``, ``sampling``, ``dtype`` of the
    sampling model as the rollout task records them); ``policy_ids``: the distinct
    ``policy_id`` values of its rows; ``policy_id``: the policy being updated;
    ``model_dtype``: its parameters' dtype (``"float32"``); the rest: the update's settings.
    ``sampler`` is taken as asked (the caller vouches for it) except with the engine
    correction, which it would turn into a ratio of 1.
    """
    if mode not in OLD_LOGPROBS_MODES:
        raise ValueError(f"old_logprobs must be one of {OLD_LOGPROBS_MODES}, got {mode!r}")
    if mode == "recompute":
        return "recompute", "rl.old_logprobs=recompute"
    if engine_correction:
        if mode == "sampler":
            raise ValueError(
                "rl.old_logprobs=sampler with rl.vllm_importance_sampling_correction: the "
                "correction's ratio would be 1 on every token; use auto or recompute"
            )
        return "recompute", "the engine correction compares the trainer's log-probs"
    if mode == "sampler":
        return "sampler", "rl.old_logprobs=sampler"
    why = _unsafe(
        file_meta,
        policy_ids,
        policy_id,
        temperature,
        model_dtype,
        bf16=bf16,
        fp16=fp16,
        quantized=quantized,
        disable_dropout=disable_dropout,
    )
    if why:
        return "recompute", why
    return "sampler", "hf engine, same policy, float32, unprocessed sampling distribution"


def _unsafe(
    meta: dict,
    policy_ids: set[str],
    policy_id: str,
    temperature: float,
    model_dtype: str,
    *,
    bf16: bool,
    fp16: bool,
    quantized: bool,
    disable_dropout: bool,
) -> str | None:
    """Why the sampler's log-probs may differ from the recompute pass's, or None."""
    if meta.get("engine") != "hf":
        return f"rows sampled by engine {meta.get('engine')!r}, not hf"
    if policy_ids != {policy_id}:
        return f"rows sampled by policies {sorted(policy_ids)}, the update starts from {policy_id}"
    sampling = meta.get("sampling") or {}
    if sampling.get("temperature") != temperature:
        return (
            f"sampling temperature {sampling.get('temperature')!r} is not the update's "
            f"{temperature}"
        )
    processed = [k for k, v in NEUTRAL_SAMPLING.items() if sampling.get(k, v) != v]
    if processed:
        return f"processed sampling distribution ({', '.join(processed)})"
    if meta.get("dtype") != "float32" or model_dtype != "float32":
        return f"sampled in {meta.get('dtype')!r}, trained in {model_dtype!r}: not both float32"
    if bf16 or fp16:
        return "bf16/fp16 autocast in the update"
    if quantized:
        return "4-bit weights"
    if not disable_dropout:
        return "dropout is on in the update (rl.disable_dropout: false)"
    return None


def engine_correction_choice(
    setting: bool | str,
    *,
    file_meta: dict,
    model_dtype: str,
    bf16: bool = False,
    fp16: bool = False,
    quantized: bool = False,
    old_logprobs: str = "auto",
    policy_logprobs: bool = False,
) -> tuple[bool, str]:
    """``rl.vllm_importance_sampling_correction`` for these rows: ``(on, reason)``.

    ``True``/``False`` are taken as set. ``auto`` (the default) turns it on where the
    engine's numbers differ from the trainer's: another engine than ``hf`` (vLLM's kernels;
    TRL turns the correction on by default with vLLM), a sampling model not in float32, a
    trained model not in float32, bf16/fp16 autocast in the update, 4-bit weights (rows
    sampled by an older policy get the behaviour weight instead, ``rl.behaviour_weight``:
    ``grpo_core.algorithm.iteration.behaviour_weight_for``). It stays
    off where the ratio would mean nothing: the ``hf`` engine in float32 samples with the
    trainer's own module; a processed sampling distribution (``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty``) makes every ratio < 1, unless the file has the policy's own
    log-probs beside the processed ones (``policy_logprobs``: its
    ``completion_policy_logprobs``, the ratio's denominator then); ``rl.old_logprobs=sampler``
    makes it 1.
    """
    name = "rl.vllm_importance_sampling_correction"
    if setting != "auto":
        return bool(setting), f"{name}={setting}"
    differs = []
    if file_meta.get("engine") != "hf":
        differs.append(f"rows sampled by engine {file_meta.get('engine')!r}")
    if file_meta.get("dtype") != "float32":
        differs.append(f"sampled in {file_meta.get('dtype')!r}")
    if model_dtype != "float32":
        differs.append(f"trained in {model_dtype!r}")
    if bf16 or fp16:
        differs.append("bf16/fp16 autocast in the update")
    if quantized:
        differs.append("4-bit weights")
    if not differs:
        return False, "auto: the hf engine sampled with the trainer's float32 module"
    sampling = file_meta.get("sampling") or {}
    processed = [k for k, v in NEUTRAL_SAMPLING.items() if sampling.get(k, v) != v]
    if processed and not policy_logprobs:
        return False, (
            f"auto: {'; '.join(differs)}, but the sampling distribution is processed "
            f"({', '.join(processed)}), so the ratios would collapse: off"
        )
    if old_logprobs == "sampler":
        return False, f"auto: {'; '.join(differs)}, but rl.old_logprobs=sampler: off"
    return True, f"auto: {'; '.join(differs)}: engine and trainer log-probs differ"


def behaviour_logprobs_gap(file_meta: dict, *, policy_logprobs: bool) -> str | None:
    """Why a behaviour weight ``pi_prox / mu`` on these rows would not compare like with like,
    or None. The trainer's ``pi_prox`` is the full softmax at the update's temperature; the
    sampler's stored log-probs are of its processed distribution (``top_p``, ``top_k``,
    ``min_p``, ``repetition_penalty``), so without the policy's own log-probs beside them
    (``policy_logprobs``: the rollout file's ``completion_policy_logprobs``, which the hf
    engine writes) every weight carries the filter's kept mass: a row the updated policy
    sampled with ``top_p=0.9`` weighs about 0.9, with ``top_k=8`` on a small model about 0.4,
    while the ESS, blind to a common scale, still reads 1."""
    sampling = file_meta.get("sampling") or {}
    processed = [k for k, v in NEUTRAL_SAMPLING.items() if sampling.get(k, v) != v]
    if not processed or policy_logprobs or sampling.get("temperature") == 0:
        return None
    return (
        f"the rows' sampling distribution was processed ({', '.join(processed)}) and the file "
        "has no completion_policy_logprobs (an engine that does not record them, vLLM, or an "
        "older file): the behaviour weights divide by the processed log-probs and include "
        "the filter's kept mass (below 1 even on fresh rows)"
    )
