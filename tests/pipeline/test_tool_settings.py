"""The environment's knobs under one set of names: ``RolloutConfig``'s ``rollout.tool_*``
fields are ``ToolSpec``'s, copied by name; the stage cache keys and run records still take
them under their record names (grpo_core/config/tools.py: ``RECORD_NAMES``), so the keys
of tool-using stages are pinned here as ``test_cache_keys_pinned.py`` pins the others."""

from __future__ import annotations

import dataclasses
import json

import pytest

from grpo_core.config.engine import EngineSpec
from grpo_core.config.stages import EvalConfig, RLConfig, RolloutConfig
from grpo_core.config.tools import RECORD_NAMES, ToolSpec, tool_spec_of
from tasks import cache
from tasks.evaluate import eval_key
from tasks.rollout import rollout_key

KNOBS = {
    "max_turns": 3,
    "max_tool_output_tokens": 80,
    "tool_call_start": "<c>",
    "tool_call_end": "</c>",
    "tool_result_start": "<r>",
    "tool_result_end": "</r>",
    "tool_timeout_s": 2.5,
    "tool_memory_mb": 256,
    "tool_workers": 2,
    "tool_sandbox": "fresh",
    "tool_truncation_mark": "[cut]",
}
ROLLOUTS = {
    "python": {"tools": ["python"]},
    "knobs": {"tools": ["python"], **KNOBS},
    "functions": {"functions": ["calculator"]},
    "trl": {"tools": ["python"], "max_tool_calling_iterations": 2},
}
# (rollout key, eval key), computed before the knobs took the rollout section's names
PINNED = {
    "python": ("4cf298f0cfdf8a6169ea6256", "435726ed62af6553a6619761"),
    "knobs": ("dcee285fb686b3aed1e4b727", "39fb59f6b3f881979f42c553"),
    "functions": ("642a7db4babf07d2daf9d8d2", "6bc4fc07cb43c9c65d96ae04"),
    "trl": ("860a9c89a1a20811340289a1", "4d6f6382c9cf540fe55a7079"),
}


@pytest.mark.parametrize("name", sorted(ROLLOUTS))
def test_tool_using_stage_keys_are_pinned(name, tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "code_version", lambda: "pinned")
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"policy weights stand-in")
    b.write_bytes(b"prompts stand-in")
    spec = RolloutConfig(**ROLLOUTS[name]).engine_spec()
    keys = (
        rollout_key("rl_1", 3, str(a), str(b), RLConfig(), 0, spec),
        eval_key(str(a), str(b), EvalConfig(), spec),
    )
    assert keys == PINNED[name]


def test_the_record_keeps_its_names_and_their_order():
    """What stage_config.json and MLflow's parameters record: the record names, in the
    fields' order, the default sandbox left out."""
    record = RolloutConfig(tools=["python"], **KNOBS).tool_spec().as_dict()
    assert json.dumps(record) == (
        '{"tools": ["python"], "max_turns": 3, "max_tool_output_tokens": 80, '
        '"call_start": "<c>", "call_end": "</c>", "result_start": "<r>", "result_end": "</r>", '
        '"timeout_s": 2.5, "memory_mb": 256, "workers": 2, "isolation": null, '
        '"truncation_mark": "[cut]", "functions": [], "sandbox": "fresh"}'
    )
    assert "sandbox" not in ToolSpec().as_dict()


def test_the_config_knobs_are_the_specs_fields():
    """Every ToolSpec field but the sandbox's isolation (``sandbox.isolation``) is a rollout
    knob of the same name and default; ``tool_spec`` copies them as they are."""
    fields = {f.name: f.default for f in dataclasses.fields(ToolSpec)}
    knobs = RolloutConfig.model_fields
    for name, default in fields.items():
        if name in ("tools", "functions", "environment_factory", "tool_isolation"):
            # the environment itself (the factories are normalised to pairs), and a
            # setting of the sandbox section
            continue
        assert name in knobs and knobs[name].default == default, name
    assert RolloutConfig(tools=["python"]).tool_spec() == ToolSpec()
    spec = RolloutConfig(tools=["python"], **KNOBS).tool_spec()
    assert {k: getattr(spec, k) for k in KNOBS} == KNOBS
    assert set(RECORD_NAMES) <= set(fields)


def test_a_record_reads_back_under_either_set_of_names():
    spec = RolloutConfig(tools=["python"], **KNOBS).tool_spec()
    assert tool_spec_of(spec.as_dict()) == spec  # a run record's (older) names
    assert tool_spec_of(dataclasses.asdict(spec)) == spec  # the field names
    engine = EngineSpec("hf", tools=spec)
    assert EngineSpec.of(engine.settings()) == engine
    assert tool_spec_of(ToolSpec().as_dict()) == ToolSpec()  # the default sandbox, left out


def test_an_environment_reads_the_knobs_under_their_record_names_too():
    """Environments written against the older field names (``spec.call_end``,
    ``spec.timeout_s``) read the same values; unknown names still fail."""
    spec = ToolSpec(tool_timeout_s=2.5, tool_call_end="</run>", tool_workers=3)
    for field_name, record in RECORD_NAMES.items():
        assert getattr(spec, record) == getattr(spec, field_name)
    assert (spec.timeout_s, spec.call_end, spec.workers) == (2.5, "</run>", 3)
    with pytest.raises(AttributeError):
        spec.no_such_knob  # noqa: B018
