"""On vLLM, rows of an older policy (``rl.async_level`` > 0) weighed by ``rl.behaviour_weight``
under a filtered sampling distribution (``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``) would carry the filter's kept mass in every weight, since vLLM
records the filtered log-probs only: refused before anything runs (it only warned at each
update), naming the setting and the ways out; the hf engine, full-distribution sampling,
``behaviour_weight: none`` and on-policy stages pass."""

from __future__ import annotations

import pytest

from flows.config import load_config
from flows.preflight import check_engine
from grpo_core.errors import UserError

VLLM = ["rollout.engine=vllm", "rl.async_level=1"]


def _passes(overrides):
    """The behaviour check passes: any error left is vLLM's absence from this venv."""
    try:
        check_engine(load_config(None, overrides))
    except UserError as e:
        assert "vllm is not installed" in str(e), e


@pytest.mark.parametrize("knob", ["rl.top_p=0.9", "rl.top_k=8", "rl.min_p=0.05",
                                  "rl.repetition_penalty=1.1"])  # fmt: skip
def test_a_filtered_distribution_with_behaviour_weights_on_vllm_is_refused(knob):
    with pytest.raises(UserError) as e:
        check_engine(load_config(None, [*VLLM, knob]))
    message = str(e.value)
    assert "\n" not in message and "rl.behaviour_weight=token_mask" in message
    assert knob.split(".")[1] in message and "rl.behaviour_weight=none" in message


def test_rl_2_is_checked_with_its_own_overrides():
    with pytest.raises(UserError, match=r"rl_2.behaviour_weight"):
        check_engine(load_config(None, ["rollout.engine=vllm", "rl_2={async_level: 1, top_k: 8}"]))


@pytest.mark.parametrize(
    "overrides",
    [
        [*VLLM],  # the full distribution
        [*VLLM, "rl.top_p=0.9", "rl.behaviour_weight=none"],
        ["rollout.engine=vllm", "rl.top_p=0.9"],  # on-policy: no behaviour weight
        ["rollout.engine=hf", "rl.async_level=1", "rl.top_p=0.9"],  # hf records both
    ],
)
def test_what_is_not_biased_passes(overrides):
    _passes(overrides)
