"""Pre-flight checks of the rewards: every name loads as a reward function with TRL's
signature, weights are finite, the data has the columns the built-in rewards read, and
rewards that run model-written code have a working sandbox."""

from __future__ import annotations

import inspect
import math

from flows.preflight._util import first_line
from grpo_core.errors import UserError


def load_reward(name: str, field: str):
    """The reward function ``name`` (registered, or a ``module:function`` spec), imported
    now; any failure is a ``UserError`` naming ``field``."""
    from grpo_core import rewards

    try:
        fn = rewards.get(name)
    except ValueError as e:  # unknown name (lists the valid ones), bad spec, missing file
        raise UserError(f"{field}: {first_line(e)}") from None
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
            f"{field}: importing reward {name!r} failed: {type(e).__name__}: {first_line(e)}"
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
    """Rewards that run model-written code (registered with ``executes``) need a sandbox
    this machine can provide (``sandbox.isolation``); probed now (it runs a tiny program)
    instead of at scoring."""
    from grpo_core import rewards

    if not rewards.executing(names):
        return
    from grpo_core.sandbox.isolation import SandboxUnavailable, detect_isolation

    sandbox = getattr(cfg, "sandbox", None)
    try:
        detect_isolation(sandbox.isolation if sandbox is not None else None)
    except SandboxUnavailable as e:
        raise UserError(f"sandbox.isolation: {' '.join(str(e).split())}") from None


def eval_rewards(cfg) -> tuple[list[str], str]:
    return [cfg.eval.accuracy_reward, cfg.eval.format_reward], "eval.accuracy_reward"


def check_reward_names(cfg) -> None:
    load_reward(cfg.eval.accuracy_reward, "eval.accuracy_reward")
    load_reward(cfg.eval.format_reward, "eval.format_reward")


def check_reward_columns(rows: list[dict], path, field: str, names, setting: str) -> None:
    """Every row has the columns the registered rewards in ``names`` read (their
    registration's ``columns``)."""
    from grpo_core import rewards

    for name in names:
        any_of = rewards.spec(name).any_of
        row = next((i for i, r in enumerate(rows) if not any(c in r for c in any_of)), None)
        if any_of and row is not None:
            where = f"{path}, row {row}" if len(rows) > 1 else str(path)
            raise UserError(
                f"{field}: {where}: none of the columns {', '.join(map(repr, any_of))}, one of "
                f"which reward {name!r} reads its tests from; add it to the data or change "
                f"{setting}"
            )
        for col in rewards.spec(name).columns:
            row = next((i for i, r in enumerate(rows) if col not in r), None)
            if row is not None:
                where = f"{path}, row {row}" if len(rows) > 1 else str(path)
                raise UserError(
                    f"{field}: {where}: no {col!r} column, which reward {name!r} reads; add it "
                    f"to the data or change {setting}"
                )


def check_advantage_estimators(cfg) -> None:
    """``rl.advantage_estimator`` (and ``rl_2``'s) given as ``module:function`` imports and
    is a function (registered names were checked when the config loaded)."""
    from grpo_core.config.loss import ADVANTAGE_ESTIMATORS
    from grpo_core.rewards.base import load_user_function

    for name, rl in (("rl", cfg.rl), ("rl_2", cfg.rl_2_config())):
        given = rl.advantage_estimator
        if given in ADVANTAGE_ESTIMATORS:
            continue
        try:
            load_user_function(given)
        except Exception as e:
            raise UserError(f"{name}.advantage_estimator: {given!r}: {first_line(e)}") from None
