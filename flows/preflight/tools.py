"""Pre-flight checks of the rollout's engine and environment (``rollout.tools``): what would
otherwise fail after the cold start, or run to the end without a single tool call.

- ``rollout.engine: vllm`` has vLLM importable where this machine samples;
- ``rollout.tools`` names one tool, the built-in ``python`` (with a working sandbox) or an
  importable ``module:function`` environment factory;
- an episode can call it: ``max_turns`` of 2 or more, call and result markers that differ,
  and each marker is in the model's vocabulary (it encodes and decodes back to itself,
  with no unknown token: a demo model built without the tool vocabulary has none of them);
- a call can run: ``tool_memory_mb`` within this machine's memory (``tool_timeout_s`` is
  bounded by the config itself).
"""

from __future__ import annotations

import importlib.util

from flows.preflight._util import first_line
from grpo_core.config.engine import ENVIRONMENTS
from grpo_core.engines.factory_env import rollout_declarations
from grpo_core.errors import UserError

MARKERS = ("tool_call_start", "tool_call_end", "tool_result_start", "tool_result_end")


def check_engine(cfg) -> None:
    """vLLM is importable where this machine samples (a local run, or a local Ray), and no
    RL stage would weigh vLLM's rows by log-probs of a filtered distribution."""
    if cfg.rollout.engine != "vllm":
        return
    for name, rl in (("rl", cfg.rl), ("rl_2", cfg.rl_2_config())):
        _check_behaviour_weight(name, rl)
    if cfg.cluster.address:
        return
    if importlib.util.find_spec("vllm") is None:
        from grpo_core.engines.vllm_engine import INSTALL_HINT

        raise UserError(f"rollout.engine: vllm is not installed here; {INSTALL_HINT}")


def _check_behaviour_weight(name: str, rl) -> None:
    """With ``rl.async_level`` > 0, rows of an older policy are weighed by ``pi_prox / mu``
    (``rl.behaviour_weight``). vLLM records ``mu`` of its processed distribution only (no
    ``completion_policy_logprobs``), so under ``top_p``/``top_k``/``min_p``/
    ``repetition_penalty`` every weight carries the filter's kept mass (about 0.9 at
    ``top_p=0.9``, 0.4 at ``top_k=8`` on a small model): a bias, not noise. Refused."""
    from grpo_core.logprobs.old import NEUTRAL_SAMPLING

    if not rl.async_level or rl.behaviour_weight == "none" or rl.old_logprobs == "sampler":
        return
    processed = [f"{k}={getattr(rl, k)}" for k, v in NEUTRAL_SAMPLING.items()
                 if getattr(rl, k) != v]  # fmt: skip
    if processed:
        raise UserError(
            f"{name}.behaviour_weight={rl.behaviour_weight} with rollout.engine=vllm and "
            f"{', '.join(processed)}: vLLM records log-probs of the filtered distribution only, "
            "so every behaviour weight would carry the filter's kept mass; sample from the full "
            f"distribution (top_p=1, top_k=0, min_p=0, repetition_penalty=1), set "
            f"{name}.behaviour_weight=none, or use the hf engine (it records both)"
        )


def check_tools(cfg, tokenizer=None) -> None:
    """``rollout.tools`` and its settings (``tokenizer``: a loader of the model's tokenizer,
    for the markers; None: the run's model's)."""
    r = cfg.rollout
    if not r.environment:
        return
    if len(r.environment) != 1:
        raise UserError(
            f"rollout.tools: {r.tools}: give one environment, 'python' or 'module:function' "
            "(one environment may offer several functions)"
        )
    (name,) = r.environment
    if name == "python":
        _check_sandbox(cfg)
    elif name == "functions":
        _check_functions(r.functions)
        _check_template_declares_tools(cfg, tokenizer)
    elif name == "factory":
        _check_factories(r)
        _check_template_declares_tools(cfg, tokenizer)
    elif ":" in name:
        _load_environment(name)
        _build_environment(r.tool_spec())
    elif name not in ENVIRONMENTS:
        raise UserError(
            f"rollout.tools: {name!r} is not an environment: give one of "
            f"{ENVIRONMENTS.names()} (built in) or your own as 'module:function' or "
            "'path/to/file.py:function'"
        )
    if r.max_turns < 2:
        raise UserError(
            f"rollout.max_turns={r.max_turns} with rollout.tools: an episode has one model turn, "
            "so no tool call could ever run; give 2 or more"
        )
    for a, b in (("tool_call_start", "tool_call_end"), ("tool_result_start", "tool_result_end")):
        if getattr(r, a) == getattr(r, b):
            raise UserError(
                f"rollout.{a} and rollout.{b} are both {getattr(r, a)!r}: a span needs two "
                "different markers"
            )
        if not getattr(r, a) or not getattr(r, b):
            raise UserError(f"rollout.{a} / rollout.{b}: markers must be non-empty")
    _check_memory(r.tool_memory_mb)
    _check_vocabulary(cfg, tokenizer)


def _check_sandbox(cfg) -> None:
    from grpo_core.sandbox.isolation import SandboxUnavailable, detect_isolation

    try:
        detect_isolation(cfg.sandbox.isolation)
    except SandboxUnavailable as e:
        raise UserError(f"rollout.tools: python: {' '.join(str(e).split())}") from None


def _check_functions(names) -> None:
    """Each function tool loads and has a schema (type hints and a docstring)."""
    if not names:
        raise UserError("rollout.tools: functions: name the function tools in rollout.functions")
    from grpo_core.engines.functions import function_schemas

    for name in names:
        try:
            function_schemas([name])
        except Exception as e:  # not found, not importable, no type hints or docstring
            message = first_line(e).replace("reward function ", "")
            raise UserError(f"rollout.functions: {name!r}: {message}") from None


def _check_template_declares_tools(cfg, tokenizer) -> None:
    """The chat template renders ``tools``: one that ignores them (SmolLM2's, the demo's)
    would train a model that never sees its functions."""
    tok = _tokenizer(cfg, tokenizer)
    if tok is None:
        return
    from grpo_core.contracts.text import prompt_text

    probe = [{"role": "user", "content": "hi"}]
    schemas = rollout_declarations(cfg.rollout)
    if isinstance(schemas, dict):  # several environments: the first one's tools
        schemas = next(iter(schemas.values()))
    try:
        declared = prompt_text(tok, probe, schemas) != prompt_text(tok, probe)
    except Exception as e:  # a template that refuses the messages or the tools
        raise UserError(f"rollout.functions: the chat template cannot declare tools: {e}") from None
    if not declared:
        raise UserError(
            "rollout.functions: the model's chat template ignores tools, so the model would "
            "never see its functions; give the tokenizer a template with a tools section "
            "(tokenizer_config.json's chat_template; docs/tools.md shows one)"
        )
    from grpo_core.contracts.observations import encode_tool_messages

    try:  # the results come back as the template's tool messages, after the end-of-turn
        encode_tool_messages(tok, [{"role": "tool", "name": "f", "content": "1"}], 8, [])
    except ValueError as e:
        raise UserError(f"rollout.functions: {e}") from None


def _tokenizer(cfg, tokenizer):
    """The model's tokenizer (``tokenizer``: its loader), or None when it cannot be read."""
    if tokenizer is None:
        from flows.preflight.context import _model

        tokenizer = _model(cfg)[1]
    return tokenizer() if tokenizer is not None else None


def _load_environment(name: str) -> None:
    from grpo_core.rewards.base import load_user_function

    try:
        load_user_function(name)
    except ModuleNotFoundError as e:
        raise UserError(
            f"rollout.tools: cannot import module {e.name!r} for environment {name!r}; check "
            "the spelling, install it, or add its folder to PYTHONPATH"
        ) from None
    except SyntaxError as e:
        raise UserError(
            f"rollout.tools: {e.filename}, line {e.lineno}: syntax error in environment "
            f"{name!r} ({e.msg})"
        ) from None
    except Exception as e:  # a missing file or attribute, a module that raised on import
        message = first_line(e).replace("reward function ", "")
        raise UserError(f"rollout.tools: environment {name!r}: {message}") from None


def _check_factories(r) -> None:
    """Each ``rollout.environment_factory`` imports, makes an object with ``reset`` and tool
    methods whose schemas can be read (one object each, as every sampling stage will)."""
    from grpo_core.engines.factory_env import factory_schemas

    for name, spec in r.factories().items():
        where = f"rollout.environment_factory{'.' + name if name else ''}"
        try:
            factory_schemas(spec)
        except ModuleNotFoundError as e:
            raise UserError(f"{where}: cannot import module {e.name!r} for {spec!r}") from None
        except (Exception, SystemExit) as e:
            raise UserError(f"{where}: {spec!r}: {type(e).__name__}: {first_line(e)}") from None


def _build_environment(spec) -> None:
    """The user's factory called once with the run's settings, as every sampling stage will
    call it: one that raises is refused here, in one line, before the cold start."""
    from grpo_core.engines.environments import environment

    try:
        env = environment(spec)
    except (Exception, SystemExit) as e:
        raise UserError(
            f"rollout.tools: environment {spec.tools[0]!r} raised when built with the run's "
            f"settings: {type(e).__name__}: {first_line(e)}"
        ) from None
    if not callable(getattr(env, "start", None)):
        raise UserError(
            f"rollout.tools: environment {spec.tools[0]!r} built a {type(env).__name__} "
            "without a start(row) method (docs/tools.md, 'Your own environment')"
        )


def _check_memory(memory_mb: int) -> None:
    import psutil

    total = psutil.virtual_memory().total >> 20
    if memory_mb > total:
        raise UserError(
            f"rollout.tool_memory_mb={memory_mb}: more than this machine's {total} MiB, so "
            "every call would fail to start; give at most that"
        )


def _check_vocabulary(cfg, tokenizer) -> None:
    tok = _tokenizer(cfg, tokenizer)
    if tok is None:
        return  # check_checkpoint reports an unreadable model
    unk = getattr(tok, "unk_token_id", None)
    for field in MARKERS:
        marker = getattr(cfg.rollout, field)
        ids = tok(marker, add_special_tokens=False)["input_ids"]
        back = tok.decode(ids, skip_special_tokens=False)
        if (unk is not None and unk in ids) or back != marker:
            pieces = tok.convert_ids_to_tokens(ids)
            shown = " ".join(pieces[:6]) + (
                f" ... ({len(pieces)} tokens)" if len(pieces) > 6 else ""
            )
            raise UserError(
                f"rollout.{field}: {marker!r} is not in the model's vocabulary (it tokenises "
                f"to {shown}), so the model can never write or read it; use markers its "
                "tokenizer has (a demo model: model.demo.vocabulary: tools)"
            )
    _check_mark(cfg.rollout.tool_truncation_mark, tok, unk)


def _check_mark(mark: str, tok, unk) -> None:
    """The truncation mark is spelled by the vocabulary as the tool's output is (special
    tokens split): a mark of unknown tokens would show the model UNK ids where output was
    cut. An empty mark puts none."""
    from grpo_core.contracts.observations import encode_mark

    ids = encode_mark(tok, mark)
    if unk is not None and unk in ids:
        pieces = tok.convert_ids_to_tokens(ids)
        shown = " ".join(pieces[:8]) + (f" ... ({len(pieces)} tokens)" if len(pieces) > 8 else "")
        raise UserError(
            f"rollout.tool_truncation_mark: {mark!r} is not in the model's vocabulary (it "
            f"tokenises to {shown}); give a mark its tokenizer spells, or '' for none"
        )
