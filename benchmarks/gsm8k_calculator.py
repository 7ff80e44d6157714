"""GSM8K with the calculator as a JSON function tool: the data files for
``benchmarks/bench_gsm8k_tools.py``.

GSM8K's training solutions carry the calculator annotations its authors used
(``16 - 3 - 4 = <<16-3-4=9>>9 duck eggs``). Each annotation becomes a model turn that ends in
a ``calculator`` call (Hermes/Qwen JSON in ``<tool_call>``), answered by a ``tool`` message with
the built-in calculator's own result; the last turn gives ``<answer>N</answer>``. The same
solutions with the annotations removed are the cold start without the tool.

    python benchmarks/gsm8k_calculator.py GSM8K OUT [--max-calls 2] [--n-sft 512] [--n-eval 100]

GSM8K is a folder holding ``train.jsonl`` and ``test.jsonl`` (github.com/openai/grade-school-math,
``grade_school_math/data``) or a dataset id that ``datasets.load_dataset(ID, "main")`` reads
(``openai/gsm8k``). Only problems whose solution makes 1 to ``--max-calls`` calculator calls,
each reproduced exactly by the built-in calculator, are kept (a 135M model on 2 cores cannot
learn the long ones in an hour). The held-out rows are the first ``--n-eval`` such problems
of the test split, in the file's order; nothing of the test split is shipped with the project.
"""

from __future__ import annotations

import argparse
import json
import re
from fractions import Fraction
from pathlib import Path

from grpo_core.contracts.columns import gsm8k_answer
from grpo_core.engines.functions import calculator, function_schemas

ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
SYSTEM = {
    "with": "Solve the problem. Use the calculator for every calculation, then give the number "
    "in <answer></answer>.",
    "without": "Solve the problem. Show the calculation in <think></think>, then give the number "
    "in <answer></answer>.",
}


def load_split(source: str, split: str) -> list[dict]:
    """GSM8K's ``split`` rows (``question``, ``answer``) from a folder of jsonl files or a
    dataset id."""
    folder = Path(source)
    if folder.is_dir():
        path = folder / f"{split}.jsonl"
        if not path.exists():
            raise SystemExit(f"{path}: not found (expected GSM8K's {split}.jsonl in {folder})")
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    import datasets

    return list(datasets.load_dataset(source, "main", split=split))


def _number(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def calls_of(solution: str) -> list[tuple[str, str]] | None:
    """Each annotation's expression and the calculator's result for it, or None when the
    calculator refuses one or disagrees with the annotated value."""
    out = []
    for expr, value in ANNOTATION.findall(solution):
        got = calculator(expr)
        if got.startswith("Error") or _number(got) is None or _number(got) != _number(value):
            return None
        out.append((expr, got))
    return out


def _call(expr: str) -> str:
    body = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
    return f"<tool_call>{body}</tool_call>"


def tool_conversation(solution: str, answer: str) -> list[dict] | None:
    """The solution as assistant turns that each end in one calculator call, the tool's
    answers between them, and a last turn with ``<answer>``."""
    calls = calls_of(solution)
    if not calls:
        return None
    pieces = ANNOTATION.split(solution.rsplit("####", 1)[0])  # text, expr, value, text, ...
    texts = pieces[0::3]
    messages = []
    for text, (expr, result) in zip(texts[:-1], calls, strict=True):
        said = text.strip().rstrip("$").rstrip()
        messages.append({"role": "assistant", "content": f"{said}\n{_call(expr)}".lstrip()})
        messages.append({"role": "tool", "name": "calculator", "content": result})
    messages.append(
        {"role": "assistant", "content": f"{texts[-1].strip()}\n<answer>{answer}</answer>"}
    )
    return messages


def worked(solution: str, answer: str) -> str:
    """The solution without its annotations, in the R1 layout."""
    reasoning = ANNOTATION.sub("", solution.rsplit("####", 1)[0]).strip()
    return f"<think>{reasoning}</think>\n<answer>{answer}</answer>"


def usable(rows: list[dict], max_calls: int) -> list[dict]:
    out = []
    for r in rows:
        answer = gsm8k_answer(r["answer"])
        n = len(ANNOTATION.findall(r["answer"]))
        if answer is None or _number(answer) is None or not 1 <= n <= max_calls:
            continue
        if calls_of(r["answer"]) is None:
            continue
        out.append({"question": r["question"], "solution": r["answer"], "answer": answer})
    return out


def _prompt(arm: str, question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM[arm]}, {"role": "user", "content": question}]


def write_files(source: str, out: Path, *, max_calls: int = 2, n_sft: int = 512,
                n_eval: int = 100) -> dict[str, int]:  # fmt: skip
    """Writes ``sft-with.jsonl``, ``sft-without.jsonl``, ``rl-{arm}.jsonl`` and
    ``eval-{arm}.jsonl`` under ``out`` (the arms differ only in the system prompt and the
    cold start's completions); returns the row counts."""
    train, test = (
        usable(load_split(source, "train"), max_calls),
        usable(load_split(source, "test"), max_calls),
    )
    if len(train) <= n_sft or len(test) < n_eval:
        raise SystemExit(f"{source}: {len(train)} train / {len(test)} test problems with 1-{max_calls} "
                         f"calls; need more than {n_sft} and at least {n_eval}")  # fmt: skip
    schemas = json.dumps(function_schemas(["calculator"]))
    out.mkdir(parents=True, exist_ok=True)
    splits = {"sft": train[:n_sft], "rl": train[n_sft:], "eval": test[:n_eval]}
    counts = {}
    for arm in ("with", "without"):
        for split, rows in splits.items():
            lines = []
            for r in rows:
                row = {"prompt": _prompt(arm, r["question"]), "answer": r["answer"]}
                if arm == "with":
                    row["tools"] = schemas
                if split == "sft":
                    row["completion"] = (tool_conversation(r["solution"], r["answer"])
                                         if arm == "with" else worked(r["solution"], r["answer"]))  # fmt: skip
                lines.append(json.dumps(row) + "\n")
            path = out / f"{split}-{arm}.jsonl"
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(lines))
            tmp.rename(path)
            counts[split] = len(lines)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gsm8k", help="folder with train.jsonl/test.jsonl, or a dataset id")
    p.add_argument("out")
    p.add_argument("--max-calls", type=int, default=2)
    p.add_argument("--n-sft", type=int, default=512)
    p.add_argument("--n-eval", type=int, default=100)
    a = p.parse_args()
    print(write_files(a.gsm8k, Path(a.out), max_calls=a.max_calls, n_sft=a.n_sft, n_eval=a.n_eval))


if __name__ == "__main__":
    main()
