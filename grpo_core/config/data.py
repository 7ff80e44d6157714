"""The ``data`` section: where prompts come from and how columns map (docs/data.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo_core.config.section import Section


class DemoDataConfig(Section):
    digits: int = Field(3, ge=1, le=6)
    n_sft: int = Field(1000, ge=1)
    n_rl: int = Field(20000, ge=1)
    n_dev: int = Field(100, ge=0, description="SFT early-stop split, disjoint from eval")
    n_eval: int = Field(200, ge=1)


class WordProblemsConfig(Section):
    """``data.source: word_problems``: generated arithmetic word problems
    (grpo_core/demo/word_problems.py), for a small pretrained chat model."""

    n_sft: int = Field(400, ge=1)
    n_rl: int = Field(2000, ge=1)
    n_dev: int = Field(0, ge=0, description="SFT early-stop split, disjoint from eval")
    n_eval: int = Field(100, ge=1)
    max_number: int = Field(20, ge=5, description="largest number in a problem")
    tools: bool = Field(False, description="SFT traces compute with the python tool")


class MultiplyConfig(Section):
    """``data.source: multiply``: 3-digit x 2-digit products (grpo_core/demo/multiply.py),
    the tool demo's task."""

    n_sft: int = Field(1000, ge=1)
    n_rl: int = Field(20000, ge=1)
    n_dev: int = Field(0, ge=0, description="SFT early-stop split, disjoint from eval")
    n_eval: int = Field(200, ge=1)
    tools: bool = Field(True, description="SFT traces call the python tool (else worked out)")
    balance_sft: bool = Field(
        False,
        description="half the SFT problems have a 4-digit product, half a 5-digit one (swapped "
        "with RL problems; about a fifth of all products have 4 digits)",
    )
    balance_rl: bool = Field(
        False,
        description="the RL split holds as many 4-digit products as 5-digit ones (the surplus "
        "5-digit ones dropped): RL samples both kinds equally often",
    )


class DataConfig(Section):
    """Where the prompts come from and how a plain dataset's columns become the pipeline's
    ``prompt``/``answer``/``completion`` (docs/data.md)."""

    source: Literal["demo", "files", "word_problems", "multiply"] = "demo"
    sft_path: str | None = None
    rl_path: str | None = None
    eval_path: str | None = None
    dev_path: str | None = Field(None, description="files: dev split for sft.target_accuracy")
    preset: Literal["gsm8k", "math"] | None = Field(
        None, description="gsm8k: question / '#### answer'; math: problem / last \\boxed{}"
    )
    prompt_column: str | None = Field(None, description="column holding the prompt")
    answer_column: str | None = Field(None, description="column holding the gold answer")
    completion_column: str | None = Field(None, description="column holding the SFT target")
    template: str | None = Field(
        None, description="prompt as a format string over the row's columns: 'Solve: {question}'"
    )
    system_prompt: str | None = Field(None, description="prepended as a system message")
    chat: bool = Field(True, description="mapped text prompts become a user message")
    max_prompt_chars: int = Field(
        200_000, ge=1, description="longest prompt accepted, in characters (checked up front)"
    )
    demo: DemoDataConfig = DemoDataConfig()
    word_problems: WordProblemsConfig = WordProblemsConfig()
    multiply: MultiplyConfig = MultiplyConfig()

    @model_validator(mode="after")
    def _paths_given(self) -> DataConfig:
        if self.source == "files":
            missing = [k for k in ("sft_path", "rl_path", "eval_path") if not getattr(self, k)]
            if missing:
                raise ValueError(f"data.source is 'files' but {', '.join(missing)} not set")
        self.mapping()  # template and system-prompt settings are checked here
        return self

    def mapping(self):
        """The ``grpo_core.contracts.columns.RowMapping`` of these settings."""
        from grpo_core.contracts.columns import RowMapping

        return RowMapping(
            preset=self.preset,
            prompt_column=self.prompt_column,
            answer_column=self.answer_column,
            completion_column=self.completion_column,
            template=self.template,
            system_prompt=self.system_prompt,
            chat=self.chat,
        )
