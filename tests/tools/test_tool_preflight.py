"""Malformed tool settings fed to the real ``grpo run --config configs/demo-tools.yaml`` (a
fresh process each): every one (an unknown or repeated environment, a missing file or
module, timeouts and memory limits out of range, tool-call markers the vocabulary lacks,
one turn, SFT mask spans; function tools with a template that ignores them, a missing
function) is refused by the pre-flight check (flows/preflight/tools.py) in one line on
stderr, exit code 2, no traceback, nothing written. The cases are
benchmarks/preflight_cases.py's ``TOOL_CASES``; their timing is benchmarks/bench_preflight.py's."""

from __future__ import annotations

import pytest

from benchmarks.preflight_cases import TOOL_CASES, problems, run_case


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The commands' working directory; the tool cases read no other input."""
    d = tmp_path_factory.mktemp("tool_preflight")
    (d / "work").mkdir()
    return {"work": d / "work", "dir": str(d)}


@pytest.mark.parametrize("case", TOOL_CASES, ids=[c[0] for c in TOOL_CASES])
def test_a_bad_tool_setting_is_one_line_exit_2_and_writes_nothing(inputs, case):
    out = run_case(case, inputs)
    assert not problems(case, out), (problems(case, out), out.stderr[-3000:])
