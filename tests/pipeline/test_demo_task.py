import re

from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core.demo.task import make_splits, worked_trace
from grpo_core.rewards import get


def test_worked_trace_is_column_addition_with_carries():
    assert worked_trace(357, 468) == "<think>7+8=15,5+6+1=12,3+4+1=8</think><answer>825</answer>"
    assert worked_trace(100, 200) == "<think>0+0=0,0+0=0,1+2=3</think><answer>300</answer>"


def test_traces_score_full_reward():
    s = make_splits(1, n_sft=50, n_rl=10, n_dev=5, n_eval=5)
    comps = [r["completion"] for r in s.sft]
    answers = [r["answer"] for r in s.sft]
    prompts = [r["prompt"] for r in s.sft]
    assert get("accuracy")(prompts, comps, answer=answers) == [1.0] * 50
    assert get("format")(prompts, comps) == [1.0] * 50


def test_splits_are_disjoint_and_seeded():
    s = make_splits(3, n_sft=300, n_rl=2000, n_dev=50, n_eval=100)
    keys = {
        name: {r["prompt"][0]["content"] for r in getattr(s, name)}
        for name in ("sft", "rl", "dev", "eval")
    }
    assert [len(k) for k in keys.values()] == [300, 2000, 50, 100]
    names = list(keys)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not keys[a] & keys[b], (a, b)
    assert make_splits(3, n_sft=300, n_rl=2000, n_dev=50, n_eval=100) == s
    assert make_splits(4, n_sft=300, n_rl=2000, n_dev=50, n_eval=100) != s


def test_tiny_model_loads_through_auto_classes(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    assert model.config.model_type == "qwen2"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "12+34"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>12+34<|assistant|>"
    ids = tok(text + worked_trace(12, 34), add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text + worked_trace(12, 34)
    # tags are single tokens: the trace costs one token per character or tag
    assert len(ids) == 2 + len("12+34") + len(
        re.sub(r"</?(think|answer)>", "#", worked_trace(12, 34))
    )
