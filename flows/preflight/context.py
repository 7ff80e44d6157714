"""Pre-flight check of lengths against the model's context (grpo_core/engines/context.py): every
``max_completion_length`` leaves room for a prompt, and, for data files, every prompt's tokens
plus the completion fit. The model's positions come from its config.json (``model.path``) or
the demo model's settings; prompts are tokenised with its tokenizer (no weights are loaded)."""

from __future__ import annotations

import json

from grpo_core.engines.context import check_completion_length, check_prompt_lengths, model_context
from grpo_core.engines.factory_env import rollout_declarations
from grpo_core.errors import UserError


def _model(cfg):
    """``(context, tokenizer loader)`` of the run's model."""
    if cfg.model.source == "path":
        from grpo_core.training.checkpoint import resolve_model_path

        path = resolve_model_path(cfg.model.path)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None, None  # check_checkpoint reports it

        def tokenizer():
            from grpo_core.training.tokenizers import saved_tokenizer

            return saved_tokenizer(path, local_files_only=True)

        return model_context(config), tokenizer
    from grpo_core.config.model import DEMO_CONTEXT

    def demo_tokenizer():  # imports transformers: only when there are data files to check
        from grpo_core.demo.model import build_tokenizer

        return build_tokenizer(cfg.model.demo.vocabulary)

    return DEMO_CONTEXT, demo_tokenizer


def check_context(cfg, data: dict[str, tuple[str, list[dict]]] | None = None) -> None:
    """``data``: ``{field: (path, rows)}`` of the prompt files already loaded."""
    context, tokenizer = _model(cfg)
    if context is None:
        return
    rl2 = cfg.rl_2_config()
    lengths = {
        "rl.max_completion_length": cfg.rl.max_completion_length,
        "rl_2.max_completion_length": rl2.max_completion_length,
        "rejection_sampling.max_completion_length": cfg.rejection_sampling.max_completion_length,
        "eval.max_completion_length": cfg.eval.max_completion_length,
    }
    for field, n in lengths.items():
        check_completion_length(n, context, field)
    if not data:
        return
    from grpo_core.contracts.text import row_prompt_ids
    from tasks.prepare import _declared

    tok = tokenizer()
    tools = rollout_declarations(cfg.rollout)  # prepare declares them in every row's prompt
    longest = max(lengths["rl.max_completion_length"], lengths["rl_2.max_completion_length"])
    budget = {
        "data.rl_path": ("rl.max_completion_length", longest),
        "data.eval_path": ("eval.max_completion_length", lengths["eval.max_completion_length"]),
        "data.dev_path": ("eval.max_completion_length", lengths["eval.max_completion_length"]),
    }
    for field, (path, rows) in data.items():
        setting, n = budget[field]
        try:
            declared = _declared(rows, tools, f"{field} {path}")  # as prepare writes them
            ids = [row_prompt_ids(tok, r) for r in declared]
        except Exception as e:  # a chat template that refuses the messages, ...
            raise UserError(f"{field} {path}: the tokenizer cannot encode a prompt: {e}") from None
        check_prompt_lengths(
            ids, context=context, max_new_tokens=n, field=setting, source=f"{field} {path}",
            unit="row",
        )  # fmt: skip


# memory one sampled token takes on its way through an iteration: in the Sample lists (an int
# and a float object with their list slots, ~68 B), the rollout and scored tables (~12 B) and
# the update's padded tensors (ids twice, masks, log-probs: ~28 B)
BYTES_PER_TOKEN = 100


def check_batch_fits(cfg, available: int | None = None) -> None:
    """One RL iteration's completions (``prompts_per_iteration`` x ``num_generations`` of up to
    ``max_completion_length`` tokens, plus their prompts) must fit in the memory this machine
    has free, or the run would be ended by the kernel's OOM killer with no message."""
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    context, _ = _model(cfg)
    for name, rl in (("rl", cfg.rl), ("rl_2", cfg.rl_2_config())):
        rows = rl.prompts_per_iteration * rl.num_generations
        tokens = rows * (rl.max_completion_length + min(context or 512, 512))
        need = tokens * BYTES_PER_TOKEN
        if need > available:
            raise UserError(
                f"{name}.num_generations={rl.num_generations} x {name}.prompts_per_iteration="
                f"{rl.prompts_per_iteration}: one iteration samples {rows:,} completions of up to "
                f"{rl.max_completion_length} tokens, about {need / 2**30:,.1f} GiB to hold, and "
                f"this machine has {available / 2**30:.1f} GiB free; lower them"
            )
