"""Tool-using SFT traces: the tool's output is context, not a target (``sft.mask_spans``),
and the generated tasks' tool traces call code that gives their answer."""

from __future__ import annotations

from grpo_core.demo import multiply, word_problems
from grpo_core.demo.model import build_tokenizer
from grpo_core.engines.environments import ToolSpec, called_code
from grpo_core.training.sft import collate
from grpo_core.training.sft_examples import encode_examples, split_spans

SPANS = (("<tool_response>", "</tool_response>"),)


def test_spans_split_the_completion_and_an_open_span_runs_to_the_end():
    assert split_spans("a<tool_response>5</tool_response>b", SPANS) == [
        ("a", 1),
        ("<tool_response>5</tool_response>", 0),
        ("b", 1),
    ]
    assert split_spans("x<tool_response>5", SPANS) == [("x", 1), ("<tool_response>5", 0)]
    assert split_spans("plain", SPANS) == [("plain", 1)]


def test_the_tool_output_gets_no_sft_loss_and_the_rest_does():
    tok = build_tokenizer("tools")
    row = {
        "prompt": [{"role": "user", "content": "12*3"}],
        "completion": multiply.tool_trace(12, 3),
    }
    ((prompt, completion),) = encode_examples(tok, [row], SPANS)
    plain = encode_examples(tok, [row])[0][1]
    assert list(completion) == plain  # the same tokens (markers are single tokens here)
    masked = [t for t, m in zip(completion, completion.mask, strict=True) if m == 0]
    assert tok.decode(masked) == "<tool_response>36</tool_response>"
    _, _, labels = collate([(prompt, completion)], tok.pad_token_id)
    target = labels[0, len(prompt) :].tolist()
    assert [t for t, m in zip(target, completion.mask, strict=True) if m == 0] == [-100] * 4
    assert all(t != -100 for t, m in zip(target, completion.mask, strict=True) if m == 1)


def test_generated_tool_traces_call_code_that_gives_the_answer():
    spec = ToolSpec()
    rows = multiply.make_splits(0, n_sft=20, n_rl=1, n_dev=0, n_eval=1).sft
    rows += word_problems.make_splits(0, n_sft=60, n_rl=1, n_eval=1, tools=True).sft
    for r in rows:
        turn = r["completion"].split(spec.tool_result_start)[0]
        code = called_code(turn, spec)
        assert code is not None, r["completion"]
        assert str(eval(code, {"__builtins__": {}})) == r["answer"], (code, r["answer"])


def test_a_balanced_sft_split_is_half_4_digit_and_the_splits_stay_disjoint():
    def products(rows):
        return [r["prompt"][0]["content"] for r in rows]

    natural = multiply.make_splits(1, 400, 4000, 50, 100)
    balanced = multiply.make_splits(1, 400, 4000, 50, 100, balance_sft=True)
    four = sum(len(r["answer"]) == 4 for r in natural.sft)
    assert four < 100  # the natural mix: about a fifth
    assert sum(len(r["answer"]) == 4 for r in balanced.sft) == 200
    # eval and dev are untouched; SFT swapped problems with RL only, and no problem repeats
    assert balanced.eval == natural.eval and balanced.dev == natural.dev
    assert len(balanced.sft) == 400 and len(balanced.rl) == 4000
    before = set(products(natural.sft + natural.rl))
    assert set(products(balanced.sft + balanced.rl)) == before
    everything = products(balanced.sft + balanced.rl + balanced.dev + balanced.eval)
    assert len(set(everything)) == len(everything)
    for r in balanced.sft:  # each trace still computes its own product
        a, b = map(int, r["prompt"][0]["content"].split("*"))
        assert r["answer"] == str(a * b) and r["completion"] == multiply.tool_trace(a, b)


def test_with_tools_both_sft_stages_mask_the_tool_output_unless_told_otherwise():
    """With ``rollout.tools`` the cold start and re-SFT (whose rows are rejection-sampled
    episodes, tool output included) mask the tool's result markers by default; a
    ``mask_spans`` that leaves them out is refused by name, before anything runs."""
    from pathlib import Path

    import pytest

    from flows.config import load_config
    from grpo_core.errors import UserError

    tools = str(Path(__file__).resolve().parents[2] / "configs" / "demo-tools.yaml")
    markers = ["rollout.tool_result_start=<out>", "rollout.tool_result_end=</out>"]
    cfg = load_config(tools, ["sft.mask_spans=[]", "re_sft={max_steps: 3}", *markers])
    assert cfg.sft_config().mask_spans == cfg.re_sft_config().mask_spans == [("<out>", "</out>")]
    assert cfg.sft_config().training.mask_spans == (("<out>", "</out>"),)
    for bad, where in ((["sft.mask_spans=[[a, b]]"], "sft.mask_spans"),
                       (["re_sft={mask_spans: [[a, b]]}"], "re_sft.mask_spans")):  # fmt: skip
        with pytest.raises(UserError, match=f"{where}.*does not mask the tool's output"):
            load_config(tools, bad)
    plain = load_config(None, [])  # no tools: nothing masked, as before
    assert plain.sft_config().mask_spans == plain.re_sft_config().mask_spans == []


def test_an_empty_marker_is_refused_not_an_endless_loop():
    import pytest

    from flows.config import load_config
    from grpo_core.errors import UserError

    with pytest.raises(UserError, match=r"mask_spans\[0\].*non-empty"):
        load_config(None, ['sft.mask_spans=[["", "</x>"]]'])
    with pytest.raises(ValueError, match="non-empty"):
        split_spans("abc", (("<x>", ""),))


def test_a_balanced_rl_split_samples_both_lengths_equally_and_leaves_the_rest():
    natural = multiply.make_splits(1, 400, 4000, 50, 100, balance_sft=True)
    balanced = multiply.make_splits(1, 400, 4000, 50, 100, balance_sft=True, balance_rl=True)
    four = sum(len(r["answer"]) == 4 for r in balanced.rl)
    assert four * 2 == len(balanced.rl) and four == sum(len(r["answer"]) == 4 for r in natural.rl)
    assert (balanced.eval, balanced.dev, balanced.sft) == (natural.eval, natural.dev, natural.sft)
    assert all(r in natural.rl for r in balanced.rl)  # the surplus 5-digit ones dropped
