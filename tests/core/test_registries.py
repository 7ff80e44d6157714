"""One registration per reward and per loss, read by everything that needs it: the checklist
of docs/architecture.md ("Adding a built-in reward or a loss") followed once, with a toy
reward and a toy objective registered here (and removed afterwards)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from flows.preflight.rewards import check_reward_columns, check_sandbox, load_reward
from flows.rl_report import model_answer
from grpo_core import rewards
from grpo_core.algorithm import evaluation
from grpo_core.algorithm.losses import ObjectiveOut, policy_loss
from grpo_core.algorithm.micro_batch import skips_zero_loss_rows
from grpo_core.config.loss import LOSS_AGGREGATIONS, POLICY_OBJECTIVES, LossConfig, UpdateConfig
from grpo_core.config.rl import RLConfig
from grpo_core.errors import UserError
from grpo_core.rewards import code
from grpo_core.sandbox.isolation import SandboxUnavailable

REWARD = "toy_registry_reward"
OBJECTIVE = "toy_registry_entropy_bonus"
AGGREGATION = "toy_registry_sum"


def _after_equals(text: str) -> str | None:
    """The toy reward's answer: what follows the last ``=``."""
    return text.rsplit("=", 1)[1].strip() if "=" in text else None


@pytest.fixture
def toy_reward():
    @rewards.register(REWARD, columns=("gold",), extract_answer=_after_equals, executes=True)
    def toy(prompts, completions, gold=None, **kwargs):
        return [float(_after_equals(c) == g) for c, g in zip(completions, gold, strict=True)]

    yield toy
    rewards.REWARDS.remove(REWARD)
    assert REWARD not in rewards.names()


@pytest.fixture
def toy_loss():
    """An objective with an entropy bonus (``+0.1 * logp`` per token, the gradient of the
    sampled tokens' entropy estimate): not zero where the advantage is."""

    @POLICY_OBJECTIVES.register(OBJECTIVE, zero_advantage_is_zero_loss=False)
    def entropy_bonus(log_ratio, advantages, logp, bounds):
        loss = -torch.exp(log_ratio) * advantages + 0.1 * logp
        none = torch.zeros_like(loss, dtype=torch.bool)
        return ObjectiveOut(loss, none, none)

    LOSS_AGGREGATIONS.add(
        AGGREGATION, "grpo_core.algorithm.losses:agg_bnpo"
    )  # by path, as built-ins
    yield entropy_bonus
    POLICY_OBJECTIVES.remove(OBJECTIVE)
    LOSS_AGGREGATIONS.remove(AGGREGATION)
    assert OBJECTIVE not in POLICY_OBJECTIVES and AGGREGATION not in LOSS_AGGREGATIONS


def test_preflight_reads_the_columns_of_the_registration(toy_reward, tmp_path):
    assert load_reward(REWARD, "rewards") is toy_reward
    check_reward_columns([{"prompt": "p", "gold": "7"}], tmp_path, "data.rl_path", [REWARD], "r")
    with pytest.raises(UserError, match=f"no 'gold' column, which reward '{REWARD}' reads"):
        check_reward_columns([{"prompt": "p"}], tmp_path, "data.rl_path", [REWARD], "rewards")


def test_executes_flag_asks_for_the_sandbox(toy_reward, monkeypatch):
    assert rewards.executing(["format", REWARD, "accuracy"]) == [REWARD]
    assert rewards.executing(["code_tests", "code_runs", "code_compiles"]) == [
        "code_tests",
        "code_runs",
    ]

    def cannot_isolate(isolation=None):
        raise SandboxUnavailable("no isolation here")

    monkeypatch.setattr("grpo_core.sandbox.isolation.detect_isolation", cannot_isolate)
    with pytest.raises(UserError, match="sandbox.isolation: no isolation here"):
        check_sandbox([REWARD], None)
    check_sandbox(["format"], None)  # nothing executes: no probe

    monkeypatch.setattr(code, "detect_isolation", lambda isolation=None: None)
    bound = code.sandboxed(["format", REWARD], isolation="none", workers=2)
    assert list(bound) == [REWARD]
    assert bound[REWARD].keywords == {"sandbox_isolation": "none", "sandbox_workers": 2}


def test_evaluation_and_report_extract_the_answer_of_the_registration(toy_reward):
    assert rewards.spec(REWARD).extract_answer is _after_equals
    # 3 samples of one problem: the answer "7" wins the vote and is correct
    result = evaluation.EvalResult(2 / 3, 1.0, 3.0, 1, [], num_samples=3)
    evaluation._add_k_sample_metrics(result, [1.0, 1.0, 0.0], ["x=7", "y = 7", "z=8"], REWARD)
    assert result.maj_at_k == 1.0
    # a reward without an extraction (code) has no maj@k
    result = evaluation.EvalResult(2 / 3, 1.0, 3.0, 1, [], num_samples=3)
    evaluation._add_k_sample_metrics(result, [1.0, 1.0, 0.0], ["a", "a", "b"], "code_tests")
    assert result.maj_at_k is None
    assert model_answer("so x=7", (REWARD,)) == "7"
    assert model_answer("<answer>4</answer> \\boxed{5}") == "4"  # the default: tag, then boxed
    assert model_answer("\\boxed{5}") == "5"


def test_config_accepts_a_registered_loss_and_its_skip_declaration(toy_loss):
    cfg = RLConfig(objective=OBJECTIVE, loss_type=AGGREGATION)
    assert (cfg.objective, cfg.loss_type) == (OBJECTIVE, AGGREGATION)
    assert RLConfig.model_json_schema()["properties"]["objective"]["enum"] == sorted(
        ["clip", "cispo", OBJECTIVE]
    )
    assert not skips_zero_loss_rows(cfg.update_config())  # the bonus does not vanish
    assert skips_zero_loss_rows(RLConfig(loss_type=AGGREGATION).update_config())
    assert skips_zero_loss_rows(UpdateConfig(loss=LossConfig(objective="cispo", epsilon_high=5)))

    # the premise: with a zero advantage the toy loss is not zero, the clip loss is
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask, zero = torch.ones(1, 2), torch.zeros(1)
    loss, _ = policy_loss(logp, None, zero, mask, cfg.update_config().loss)
    assert loss.item() == pytest.approx(-0.15)
    assert policy_loss(logp, None, zero, mask, loss_type=AGGREGATION)[0].item() == 0.0


def test_unknown_names_fail_clearly():
    with pytest.raises(ValidationError, match=r"objective\n.*unknown policy objective 'nope'; "
                       r"valid names: cispo, clip"):  # fmt: skip
        RLConfig(objective="nope")
    with pytest.raises(ValidationError, match="unknown loss_type 'ppo'; valid names: bnpo, dapo"):
        RLConfig(loss_type="ppo")
    with pytest.raises(UserError, match="rewards: unknown reward function 'nope'; valid names"):
        load_reward("nope", "rewards")
    assert rewards.spec("my_pkg.my_mod:my_reward") == rewards.RewardSpec()  # not registered
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        LOSS_AGGREGATIONS.spec("ppo")
