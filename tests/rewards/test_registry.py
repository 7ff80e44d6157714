import textwrap

import pytest

from grpo_core import rewards


def test_builtin_names_registered():
    for name in ["accuracy", "math_verify", "format", "tag_count", "language_consistency"]:
        assert name in rewards.names()
        assert callable(rewards.get(name))


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="valid names: .*accuracy"):
        rewards.get("acuracy")


def test_register_and_duplicate():
    @rewards.register("test_registry_const")
    def const(prompts, completions, **_):
        return [0.5] * len(completions)

    assert rewards.get("test_registry_const") is const
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("test_registry_const")(lambda prompts, completions, **_: [])


def test_load_user_function_from_module_and_file(tmp_path, monkeypatch):
    src = textwrap.dedent(
        """
        def length_reward(prompts, completions, **kwargs):
            return [float(len(c)) for c in completions]

        class Holder:
            @staticmethod
            def half(prompts, completions, **kwargs):
                return [0.5 for _ in completions]

        NOT_CALLABLE = 3
        """
    )
    (tmp_path / "user_rewards_mod.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = rewards.load_user_function("user_rewards_mod:length_reward")
    assert fn(["p"], ["abc"]) == [3.0]
    assert rewards.get("user_rewards_mod:Holder.half")(["p"], ["x"]) == [0.5]
    by_file = rewards.load_user_function(f"{tmp_path / 'user_rewards_mod.py'}:length_reward")
    assert by_file(["p"], ["ab"]) == [2.0]
    with pytest.raises(ValueError, match="no attribute"):
        rewards.load_user_function("user_rewards_mod:missing")
    with pytest.raises(ValueError, match="not callable"):
        rewards.load_user_function("user_rewards_mod:NOT_CALLABLE")
    with pytest.raises(ValueError, match="module:function"):
        rewards.load_user_function("no_colon")
    with pytest.raises(ModuleNotFoundError):
        rewards.load_user_function("surely_not_a_module_xyz:f")


def test_trl_style_function_works_unchanged():
    # A reward function as written for TRL's GRPOTrainer (conversational completions).
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c[0]["content"])) for c in completions]

    res = rewards.score_completions(
        ["p", "p"],
        [[{"role": "assistant", "content": "x" * 20}], [{"role": "assistant", "content": "x"}]],
        {"trainer_state": [None, None]},
        {"len": 1.0},
        functions={"len": reward_len},
    )
    assert res.per_function["len"] == [0.0, -19.0]


@pytest.mark.parametrize(
    ("completion", "text"),
    [
        ("plain", "plain"),
        (b"\xff\xfeok", "\ufffd\ufffdok"),
        (None, ""),
        ([{"role": "assistant", "content": "a"}], "a"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "a"),
        ([{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}], "hi"),
        ({"role": "assistant", "content": "d"}, "d"),
    ],
)
def test_completion_text_forms(completion, text):
    assert rewards.completion_text(completion) == text
