"""The reward registry, user-function loading, and completion-text normalisation.

Every reward function has TRL's signature::

    fn(prompts: list, completions: list, **columns) -> list[float | None]

``completions`` are plain strings or TRL's conversational form (a list of
``{"role", "content"}`` messages per completion); ``columns`` are the prompt dataset's other
columns, one list per column, aligned with ``completions``. ``None`` means "not applicable to
this row" (TRL turns it into NaN and ignores it in the weighted sum).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.errors import RewardUnavailable  # noqa: F401  (re-exported: rewards.base.RewardUnavailable)
from grpo_core.registry import Registry

RewardFn = Callable[..., list[float | None]]


@dataclass(frozen=True)
class RewardSpec:
    """What the pipeline knows about a registered reward besides its function, declared
    where it is registered (``register(name, columns=..., ...)``):

    - ``columns``: data columns it reads and fails on every row without (preflight checks
      the data has them);
    - ``extract_answer``: ``text -> answer | None``, the answer it reads from a completion,
      for an accuracy-like reward (evaluation's maj@k votes on it, the RL report shows it);
    - ``executes``: it runs the model-written program, so it needs the code sandbox
      (preflight probes it; scoring binds its ``sandbox_<option>`` keywords, the
      isolation first: ``code.sandboxed``);
    - ``any_of``: columns of which the data must have at least one (``code_tests`` reads
      its tests from ``test``, ``test_list`` or ``tests``: without any, every score would be
      None and the run would learn nothing).

    A ``module:function`` reward is not registered and has the defaults."""

    columns: tuple[str, ...] = ()
    extract_answer: Callable[[str], str | None] | None = None
    executes: bool = False
    any_of: tuple[str, ...] = ()  # the data has at least one of these columns (code tests)


REWARDS: Registry[RewardFn] = Registry("reward function", spec=RewardSpec)


class Scores(list):
    """A list of scores that also carries one error message per row (``errors``).

    A reward function may return it instead of a plain list to report why a row scored what
    it did (a timeout, a crash) while still giving it a score (usually 0.0); it is still a
    ``list``, so TRL accepts it unchanged. ``score_completions`` puts ``errors`` into its
    error column.
    """

    def __init__(self, values=(), errors=None):
        super().__init__(values)
        self.errors: list[str | None] = list(errors) if errors is not None else [None] * len(self)


def register(
    name: str,
    *,
    replace: bool = False,
    columns: tuple[str, ...] = (),
    extract_answer: Callable[[str], str | None] | None = None,
    executes: bool = False,
    any_of: tuple[str, ...] = (),
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name`` (a taken name raises), with
    its declaration (:class:`RewardSpec`: data columns, answer extraction, executes code)."""
    return REWARDS.register(
        name, replace=replace, columns=tuple(columns), extract_answer=extract_answer,
        executes=executes, any_of=tuple(any_of),
    )  # fmt: skip


def spec(name: str) -> RewardSpec:
    """The declaration of reward ``name``; the defaults (no columns, no answer extraction,
    runs no code) for a ``module:function`` reward or any name not registered."""
    return REWARDS.spec(name) if name in REWARDS else RewardSpec()


def executing(names) -> list[str]:
    """The rewards among ``names`` that run the model-written program (``executes``)."""
    return [n for n in names if spec(n).executes]


def get(name: str) -> RewardFn:
    """The reward function registered as ``name``, or a user function ``"module:function"``.

    Unknown names raise ``ValueError`` listing the valid ones.
    """
    if ":" in name:
        return load_user_function(name)
    return REWARDS.get(name)


def names() -> list[str]:
    """Sorted names of the registered reward functions."""
    return REWARDS.names()


def load_user_function(spec: str) -> RewardFn:
    """Import ``"package.module:function"`` (or ``"path/to/file.py:function"``).

    The attribute part may be dotted (``"mod:Class.method"``). Raises ``ValueError`` for a
    malformed spec or a missing/non-callable attribute; import errors propagate unchanged.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function spec must be 'module:function', got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        if not path.is_file():
            raise ValueError(f"reward function file not found: {path}")
        mod_id = f"_grpo_user_reward_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_id)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(mod_id, path)
            assert file_spec is not None and file_spec.loader is not None
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_id] = module
            file_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attr!r} (spec {spec!r})") from None
    if not callable(obj):
        raise ValueError(f"{spec!r} is not callable (got {type(obj).__name__})")
    return obj


def completion_text(completion: Any) -> str:
    """The text of one completion, whatever form it comes in.

    - ``str``: returned as is; ``bytes``: decoded as UTF-8 with replacement characters;
    - TRL conversational form (list of ``{"role", "content"}`` dicts): the contents of the
      assistant messages joined (all messages if none has an assistant role); a content that is
      a list of parts (``{"type": "text", "text": ...}``) is joined too;
    - a single message dict; ``None`` -> ``""``.
    """
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, bytes | bytearray):
        return bytes(completion).decode("utf-8", errors="replace")
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, list | tuple):
        messages = [m for m in completion if isinstance(m, dict)]
        assistant = [m for m in messages if m.get("role") == "assistant"]
        chosen = assistant or messages
        if chosen:
            return "".join(_content_text(m.get("content")) for m in chosen)
        return "".join(completion_text(m) for m in completion)
    return str(completion)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                parts.append(str(part.get("text", "")))
            else:
                parts.append(completion_text(part))
        return "".join(parts)
    return completion_text(content)
