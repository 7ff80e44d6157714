"""Malformed inputs fed to the real ``grpo`` command (a fresh process each): every one is
found by the pre-flight check (flows/preflight/) before Prefect starts, and reported as
exactly one line on stderr that names the culprit, with exit code 2, no traceback, and
nothing written (no run folder, no MLflow store, no Prefect home). The cases and their
inputs are benchmarks/preflight_cases.py's and benchmarks/preflight_inputs.py's (the tool
settings' cases: tests/tools/test_tool_preflight.py); how long each takes (under 15 s, a
dead tracking server included) is benchmarks/bench_preflight.py's to measure."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.preflight_cases import CASES, problems, run_case
from benchmarks.preflight_inputs import write_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_checkpoint):
    """Every malformed input, written once; ``work`` is the commands' working directory."""
    with write_inputs(tmp_path_factory.mktemp("fail_fast"), tiny_checkpoint) as p:
        yield p


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_input_is_one_line_exit_2_and_writes_nothing(inputs, case):
    out = run_case(case, inputs)
    assert not problems(case, out), (problems(case, out), out.stderr[-3000:])


def test_rollout_files_record_the_fingerprint_of_the_tokenizer_json(inputs, tiny_checkpoint):
    """The fingerprint written at rollout time (from the loaded transformers tokenizer) is
    the one pre-flight computes from the checkpoint's tokenizer.json; swapping two tokens
    (same vocabulary size) changes it."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from grpo_core.contracts.rollouts import read_metadata_of, tokenizer_fingerprint

    meta = read_metadata_of(pq.read_table(inputs["scored_real"]))
    own = Tokenizer.from_file(str(Path(tiny_checkpoint) / "tokenizer.json"))
    swapped = Tokenizer.from_file(str(Path(inputs["ck_swapped"]) / "tokenizer.json"))
    assert meta["tokenizer"] == tokenizer_fingerprint(own)
    assert own.get_vocab_size() == swapped.get_vocab_size()
    assert tokenizer_fingerprint(swapped) != meta["tokenizer"]
