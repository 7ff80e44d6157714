"""A checkpoint's tokenizer, loaded as it was saved (grpo_core/training/checkpoint.py:
``load_tokenizer`` sets it up for sampling), and a tokenizer-only copy of its folder for
engines that load it themselves (vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

# tokenizer classes that only wrap a tokenizer.json (transformers 5 saves a plain fast
# tokenizer under the first name)
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def saved_tokenizer(path: str | Path, **kwargs):
    """The tokenizer saved in ``path``, as it was saved. ``AutoTokenizer`` alone is not that
    for a plain fast tokenizer (``tokenizer_class`` ``TokenizersBackend``) saved beside a
    model whose type has its own tokenizer class (qwen2, llama, ...): transformers 5 then
    builds the model type's class, whose own pre-tokenizer and decoder replace the saved
    ones (a character-level tokenizer saved with a Qwen2 model reloads as Qwen2's byte-level
    one, which drops spaces and newlines). Such a folder is loaded from its tokenizer.json
    as is; any other through ``AutoTokenizer`` (``kwargs``: its options)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if _plain_tokenizer(Path(path)):
        return PreTrainedTokenizerFast.from_pretrained(str(path), **kwargs)
    return AutoTokenizer.from_pretrained(str(path), **kwargs)


def _plain_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a plain fast tokenizer: its tokenizer.json, saved under a
    generic class name."""
    try:
        saved = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return False
    return saved in _GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file()


def plain_tokenizer_folder(path: str | Path) -> Path | None:
    """For a folder whose tokenizer :func:`saved_tokenizer` loads from its tokenizer.json
    (``AutoTokenizer`` would build another), a temporary folder with the tokenizer's files
    only, no model config: ``AutoTokenizer`` there (vLLM's) loads the saved tokenizer too.
    None for any other folder. The caller removes it."""
    import shutil
    import tempfile

    folder = Path(path)
    if not _plain_tokenizer(folder):
        return None
    out = Path(tempfile.mkdtemp(prefix="grpo-tokenizer-"))
    for f in folder.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name.startswith("special_tokens")
                            or f.name.startswith("chat_template") or f.name == "added_tokens.json"):  # fmt: skip
            shutil.copy2(f, out / f.name)
    return out
