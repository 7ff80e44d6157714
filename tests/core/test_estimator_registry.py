"""``rl.advantage_estimator`` is checked by its registry (grpo_core/config/loss.py:
``ADVANTAGE_ESTIMATORS``) when the config loads, so a typo fails before anything runs, not
at the first scoring; whether an estimator scales rewards is its registration's
``AdvantageSpec``, not a list in the config; and your own estimator is a
``module:function`` door, as rewards are, imported by the pre-flight check."""

from __future__ import annotations

import pytest
import torch

from flows.config import load_config
from flows.preflight import check_advantage_estimators
from grpo_core.algorithm import advantages as A
from grpo_core.config.loss import ADVANTAGE_ESTIMATORS
from grpo_core.config.rl import RLConfig
from grpo_core.errors import UserError

MINE = "tests.core.test_estimator_registry:centred_twice"


def centred_twice(rewards, group_ids, *, scale_rewards="none"):
    """A user's estimator: twice Dr. GRPO's advantage."""
    return 2 * A.compute("dr_grpo", rewards, group_ids)


def test_a_typo_fails_when_the_config_loads_naming_the_estimators():
    with pytest.raises(
        ValueError, match=r"unknown advantage estimator 'grp0'.*dr_grpo, grpo, rloo"
    ):
        load_config(None, ["rl.advantage_estimator=grp0"])


def test_scaling_is_the_registrations_spec():
    assert not ADVANTAGE_ESTIMATORS.spec("rloo").scales_rewards
    with pytest.raises(ValueError, match="never scales rewards"):
        RLConfig(advantage_estimator="rloo", scale_rewards="group")
    ADVANTAGE_ESTIMATORS.add("unscaled", MINE, scales_rewards=False)
    try:
        with pytest.raises(ValueError, match="'unscaled' never scales rewards"):
            RLConfig(advantage_estimator="unscaled", scale_rewards="group")
        assert RLConfig(advantage_estimator="unscaled", scale_rewards="none")
    finally:
        ADVANTAGE_ESTIMATORS.remove("unscaled")


def test_your_own_estimator_as_module_function():
    cfg = load_config(None, [f"rl.advantage_estimator={MINE}", "rl.scale_rewards=none"])
    check_advantage_estimators(cfg)
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    got = A.compute(cfg.rl.advantage_estimator, rewards, groups, scale_rewards="none")
    assert got.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_a_door_that_does_not_import_is_one_preflight_line():
    cfg = load_config(None, ["rl.advantage_estimator=no_such_mod:fn"])
    with pytest.raises(UserError, match=r"^rl.advantage_estimator: .*'no_such_mod:fn'"):
        check_advantage_estimators(cfg)
    cfg = load_config(
        None, ["rl_2={advantage_estimator: 'tests.core.test_estimator_registry:nope'}"]
    )
    with pytest.raises(UserError, match=r"^rl_2.advantage_estimator"):
        check_advantage_estimators(cfg)
