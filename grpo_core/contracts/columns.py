"""Plain datasets into the pipeline's rows: column mapping, prompt template, system prompt and
the named presets (``gsm8k``, ``math``).

The pipeline reads ``prompt`` (text or chat messages), ``answer`` (the gold the accuracy
rewards compare with) and, for SFT, ``completion``. A dataset with other column names is
mapped by a :class:`RowMapping` (built from the ``data`` config section)::

    RowMapping(preset="gsm8k", system_prompt="Think, then answer in <answer></answer>.")
    # {"question": "...", "answer": "... #### 1,000"}
    # -> {"prompt": [{"role": "system", ...}, {"role": "user", "content": "..."}],
    #     "answer": "1000", "completion": "<think>...</think><answer>1000</answer>"}

Columns the mapping does not consume are kept, so reward functions still get them by name.
Errors name the file, the row and the column expected.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any

from grpo_core.contracts.text import extract_boxed
from grpo_core.errors import UserError


def gsm8k_answer(text: str) -> str | None:
    """GSM8K's final answer: the text after the last ``#### ``, commas removed."""
    if "####" not in text:
        return None
    ans = text.rsplit("####", 1)[1].strip().replace(",", "")
    return ans or None


def gsm8k_reasoning(text: str) -> str:
    """GSM8K's worked solution without the final-answer line and the ``<<48/2=24>>``
    calculator annotations."""
    return re.sub(r"<<[^<>]*>>", "", text.rsplit("####", 1)[0]).strip()


def math_answer(text: str) -> str | None:
    """MATH's final answer: the content of the last ``\\boxed{...}`` (nested braces kept)."""
    return extract_boxed(text)


@dataclass(frozen=True)
class Preset:
    prompt_column: str
    answer_column: str  # the column the gold answer is extracted from
    extract: Any  # (text) -> answer or None
    expected: str  # what the answer column must contain, for errors
    reasoning: Any  # (text) -> the worked solution used for the SFT completion


PRESETS: dict[str, Preset] = {
    "gsm8k": Preset(
        "question", "answer", gsm8k_answer, "a final '#### <answer>' line", gsm8k_reasoning
    ),
    "math": Preset(
        "problem", "solution", math_answer, "a \\boxed{...} answer", lambda t: t.strip()
    ),
}


def r1_completion(reasoning: str, answer: str) -> str:
    """The R1-format SFT target: ``<think>reasoning</think><answer>answer</answer>``."""
    return f"<think>{reasoning}</think><answer>{answer}</answer>"


@dataclass(frozen=True)
class RowMapping:
    """How a dataset's rows become the pipeline's ``prompt``/``answer``/``completion``.

    - ``preset``: ``gsm8k`` (prompt from ``question``, answer after ``#### `` in ``answer``,
      commas removed) or ``math`` (prompt from ``problem``, answer in the last ``\\boxed{}``
      of ``solution``); SFT rows without a completion column get the R1-format completion
      ``<think>solution</think><answer>answer</answer>``
    - ``prompt_column`` / ``answer_column`` / ``completion_column``: where those come from
      (default: the preset's, else ``prompt``/``answer``/``completion``)
    - ``template``: a format string over the row's columns (``"Solve: {question}"``); it makes
      the prompt text (``{{``/``}}`` for literal braces)
    - ``system_prompt``: prepended as a system message (unless the messages have one)
    - ``chat``: text prompts become one user message (the chat template then comes from the
      tokenizer); ``False`` keeps them as plain text
    """

    preset: str | None = None
    prompt_column: str | None = None
    answer_column: str | None = None
    completion_column: str | None = None
    template: str | None = None
    system_prompt: str | None = None
    chat: bool = True

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(
                f"data.preset {self.preset!r}: unknown; valid: {', '.join(sorted(PRESETS))}"
            )
        if self.template is not None:
            try:
                fields = [
                    f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None
                ]
            except ValueError as e:
                raise ValueError(f"data.template {self.template!r}: {e}") from None
            if not fields:
                raise ValueError(
                    f"data.template {self.template!r}: names no column; write e.g. "
                    "'Solve: {question}'"
                )
            if any(not f or f.isdigit() for f in fields):
                raise ValueError(
                    f"data.template {self.template!r}: use column names in braces, e.g. {{question}}"
                )
        if self.system_prompt is not None and not self.chat:
            raise ValueError("data.system_prompt needs chat prompts: data.chat is false")

    @property
    def identity(self) -> bool:
        """True when rows pass through unchanged."""
        return (
            self.preset is None
            and self.prompt_column in (None, "prompt")
            and self.answer_column in (None, "answer")
            and self.completion_column in (None, "completion")
            and self.template is None
            and self.system_prompt is None
        )

    def apply(self, rows: list[dict], source: str, *, sft: bool = False) -> list[dict]:
        """The mapped rows; ``source`` (the file) names where a problem is. ``sft``: the rows
        are SFT data (a preset then writes the R1-format ``completion``)."""
        if self.identity:
            return rows
        return [self._row(r, i, source, sft) for i, r in enumerate(rows)]

    def _row(self, row: dict, i: int, source: str, sft: bool) -> dict:
        if not isinstance(row, dict):
            raise UserError(
                f"{source}, row {i}: expected an object with columns, got {type(row).__name__}"
            )
        preset = PRESETS.get(self.preset) if self.preset else None
        p_col = self.prompt_column or (preset.prompt_column if preset else "prompt")
        a_col = self.answer_column or (preset.answer_column if preset else "answer")
        c_col = self.completion_column or "completion"

        def need(col: str, what: str) -> Any:
            if col not in row or row[col] is None:
                have = ", ".join(sorted(map(str, row))) or "none"
                raise UserError(
                    f"{source}, row {i}: missing column {col!r} ({what}); has {have}; "
                    f"set data.{'prompt' if what == 'the prompt' else 'answer'}_column"
                )
            return row[col]

        out = {k: v for k, v in row.items() if k not in (p_col, a_col, c_col)}
        if self.template is not None:
            try:
                prompt: Any = self.template.format_map(row)
            except KeyError as e:
                have = ", ".join(sorted(map(str, row))) or "none"
                raise UserError(
                    f"{source}, row {i}: data.template names column {e.args[0]!r}, which the row "
                    f"does not have (has {have})"
                ) from None
            except (IndexError, TypeError, AttributeError, ValueError) as e:
                raise UserError(
                    f"{source}, row {i}: data.template {self.template!r} does not fit the row ({e})"
                ) from None
        else:
            prompt = need(p_col, "the prompt")
        if isinstance(prompt, str) and self.chat:
            prompt = [{"role": "user", "content": prompt}]
        has_system = (
            bool(prompt) and isinstance(prompt[0], dict) and prompt[0].get("role") == "system"
        )
        if self.system_prompt is not None and isinstance(prompt, list) and not has_system:
            prompt = [{"role": "system", "content": self.system_prompt}, *prompt]
        out["prompt"] = prompt

        if preset is not None:
            raw = need(a_col, preset.expected)
            ans = preset.extract(str(raw))
            if ans is None:
                raise UserError(
                    f"{source}, row {i}, column {a_col!r}: expected {preset.expected} "
                    f"(data.preset {self.preset}), got {str(raw)[-80:]!r}"
                )
            out["answer"] = ans
            if c_col in row and row[c_col] is not None:
                out["completion"] = row[c_col]
            elif sft:
                out["completion"] = r1_completion(preset.reasoning(str(raw)), ans)
        else:
            if a_col in row:
                out["answer"] = row[a_col]
            if sft and c_col in row:
                out["completion"] = row[c_col]
        return out
