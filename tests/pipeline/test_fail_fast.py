"""Malformed inputs fed to the real ``grpo`` command (a fresh process each): every one is
found by the pre-flight check (flows/preflight/) before Prefect starts, and reported as
exactly one line on stderr that names the culprit, with exit code 2, no traceback, and
nothing written (no run folder, no MLflow store, no Prefect home). A dead tracking server
is found within 15 s."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fail_fast_inputs import (
    GOOD_RL,
    GOOD_SFT,
    ROOT,
    _bad_scored,
    _checkpoint,
    _jsonl,
    _parquet,
    _real_scored,
    _rollout_rows,
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_checkpoint):
    """Every malformed input, written once; ``work`` is the commands' working directory."""
    d = tmp_path_factory.mktemp("fail_fast")
    work = d / "work"
    work.mkdir()
    p = {"work": work, "ckpt": str(tiny_checkpoint)}
    p["sft"] = _jsonl(d / "sft.jsonl", GOOD_SFT)
    p["rl"] = _jsonl(d / "rl.jsonl", GOOD_RL)
    p["eval"] = _jsonl(d / "eval.jsonl", GOOD_RL)
    p["rl_no_prompt"] = _jsonl(d / "rl_no_prompt.jsonl", [GOOD_RL[0], {"question": "3+3="}])
    (d / "rl_bad_json.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    p["rl_bad_json"] = str(d / "rl_bad_json.jsonl")
    p["rl_prompt_number"] = _jsonl(d / "rl_prompt_number.jsonl", [{"prompt": 12, "answer": "2"}])
    p["rl_chat_no_content"] = _jsonl(
        d / "rl_chat.jsonl", [{"prompt": [{"role": "user"}], "answer": "2"}]
    )
    p["sft_completion_list"] = _jsonl(
        d / "sft_bad.jsonl", [{"prompt": "1+1=", "completion": ["2"]}]
    )
    p["rl_huge_prompt"] = _jsonl(d / "rl_huge.jsonl", [{"prompt": "1" * 1_000_000, "answer": "2"}])
    p["rl_mixed_types"] = _jsonl(
        d / "rl_mixed.jsonl", [GOOD_RL[0], {"prompt": "2+2=", "answer": ["4"]}]
    )
    p["rl_no_answer"] = _jsonl(d / "rl_no_answer.jsonl", [{"prompt": "1+1="}])
    p["rl_reserved"] = _jsonl(d / "rl_reserved.jsonl", [{"prompt": "1+1=", "completions": "x"}])
    (d / "empty.jsonl").write_text("\n")
    p["empty"] = str(d / "empty.jsonl")
    (d / "rl.txt").write_text("prompt,answer\n1+1=,2\n")
    p["txt"] = str(d / "rl.txt")
    (d / "rl_trunc.parquet").write_bytes(b"PAR1" + b"\0" * 40)
    p["rl_trunc_parquet"] = str(d / "rl_trunc.parquet")

    ck = Path(tiny_checkpoint)
    weights = "model.safetensors"
    size = (ck / weights).stat().st_size
    p["ck_truncated"] = _checkpoint(
        ck, d / "ck_trunc", lambda c: os.truncate(c / weights, size // 2)
    )
    p["ck_no_config"] = _checkpoint(ck, d / "ck_noconf", lambda c: (c / "config.json").unlink())
    p["ck_bad_config"] = _checkpoint(
        ck, d / "ck_badconf", lambda c: (c / "config.json").write_text("{not json")
    )

    def garbage_header(c):
        data = bytearray((c / weights).read_bytes())
        data[:8] = (10**12).to_bytes(8, "little")
        (c / weights).write_bytes(bytes(data))

    p["ck_bad_header"] = _checkpoint(ck, d / "ck_badhdr", garbage_header)

    def no_tokenizer(c):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (c / f).unlink(missing_ok=True)

    p["ck_no_tokenizer"] = _checkpoint(ck, d / "ck_notok", no_tokenizer)
    p["ck_no_weights"] = _checkpoint(ck, d / "ck_noweights", lambda c: (c / weights).unlink())

    from tokenizers import Tokenizer

    from grpo_core.contracts.rollouts import tokenizer_fingerprint

    fp = tokenizer_fingerprint(Tokenizer.from_file(str(ck / "tokenizer.json")))
    p["rollouts"] = _parquet(d / "rollouts.parquet", _rollout_rows(), tokenizer=fp)
    p["rollouts_no_ids"] = _parquet(
        d / "rollouts_noids.parquet", _rollout_rows(), drop=["completion_ids"]
    )
    (d / "rollouts_trunc.parquet").write_bytes(Path(p["rollouts"]).read_bytes()[:300])
    p["rollouts_trunc"] = str(d / "rollouts_trunc.parquet")
    oov = _rollout_rows()
    oov[5]["completion_ids"] = [6, 99, 2]
    p["scored_oov"] = _parquet(d / "scored_oov.parquet", oov, scored=True, tokenizer=fp)
    p["scored_foreign"] = _parquet(
        d / "scored_foreign.parquet", _rollout_rows(), scored=True, tokenizer="0123456789abcdef"
    )
    p["scored_no_adv"] = _parquet(
        d / "scored_noadv.parquet", _rollout_rows(), scored=True, drop=["advantage"]
    )
    p.update(_bad_scored(d, fp))  # a NaN advantage, a null one, no rows
    (d / "dup.yaml").write_text("seed: 1\nrl:\n  iterations: 3\nseed: 2\n")
    p["dup_yaml"] = str(d / "dup.yaml")
    # a real rollout file of the tiny policy, and a policy whose tokenizer has the same
    # vocabulary size but two tokens swapped
    p["scored_real"] = _real_scored(ck, d)

    def swap_two_tokens(c):
        tok = json.loads((c / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[5:7]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (c / "tokenizer.json").write_text(json.dumps(tok))

    p["ck_swapped"] = _checkpoint(ck, d / "ck_swapped", swap_two_tokens)

    (d / "bad.yaml").write_text("rl:\n  learning_rate: 1.0e-4\n   beta: 0.1\n")
    p["bad_yaml"] = str(d / "bad.yaml")
    (d / "syntax_err.py").write_text("def fn(prompts, completions, **kw)\n    return []\n")
    (d / "boom.py").write_text("raise RuntimeError('no GPU here')\n")
    (d / "sig.py").write_text("def fn(prompts, completions):\n    return [0.0] * len(prompts)\n")
    (d / "ok.py").write_text(
        "def fn(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n"
    )
    p["dir"] = str(d)

    (d / "notsqlite.db").write_text("hello")
    p["not_sqlite"] = str(d / "notsqlite.db")
    ro_db = d / "ro.db"
    ro_db.write_bytes(b"SQLite format 3\x00" + b"\0" * 84)
    ro_db.chmod(0o444)
    p["ro_db"] = str(ro_db)
    ro_dir = d / "ro_dir"
    ro_dir.mkdir()
    ro_dir.chmod(0o555)
    p["ro_dir"] = str(ro_dir)

    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    p["refused_url"] = f"http://127.0.0.1:{refused.getsockname()[1]}"
    refused.close()  # nothing listens there any more
    hole = socket.socket()  # accepts connections (kernel backlog), never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    p["hole_url"] = f"http://127.0.0.1:{hole.getsockname()[1]}"
    yield p
    hole.close()
    ro_dir.chmod(0o755)


FILES = ["--set", "data.source=files"]
TOOLS = str(ROOT / "configs" / "demo-tools.yaml")


def _files(p, sft="sft", rl="rl", ev="eval"):
    """data.source=files with the given inputs (a name of ``inputs``, or a path)."""
    paths = {"sft_path": p.get(sft, sft), "rl_path": p.get(rl, rl), "eval_path": p.get(ev, ev)}
    return [*FILES, *(a for k, v in paths.items() for a in ("--set", f"data.{k}={v}"))]


# (id, command line given the inputs, substrings the one line must contain[, environment])
CASES = [
    # config and YAML
    ("yaml_syntax", lambda p: ["run", "--config", p["bad_yaml"]], ["bad.yaml", "line 3, column"]),
    ("override_yaml", lambda p: ["run", "--set", "rl.stop=[a"], ["rl.stop", "YAML"]),
    ("unknown_key", lambda p: ["run", "--set", "rl.learning_rat=1"], ["rl.learning_rat"]),
    ("bad_value", lambda p: ["run", "--set", "rl.loss_type=ppo"], ["rl.loss_type", "ppo"]),
    ("config_missing", lambda p: ["run", "--config", "nope.yaml"], ["nope.yaml"]),
    ("rl_2_invalid", lambda p: ["run", "--set", "rl_2={num_generations: 1}"], ["rl_2."]),
    # rewards
    ("reward_typo", lambda p: ["run", "--set", "rewards={accuracyy: 1}"], ["'accuracyy'"]),
    ("reward_module", lambda p: ["run", "--set", "rewards={'nope_mod:fn': 1}"], ["nope_mod"]),
    ("reward_file", lambda p: ["run", "--set", "rewards={'missing.py:fn': 1}"], ["missing.py"]),
    (
        "reward_syntax",
        lambda p: ["run", "--set", f"rewards={{'{p['dir']}/syntax_err.py:fn': 1}}"],
        ["syntax_err.py", "line 1"],
    ),
    (
        "reward_import_raises",
        lambda p: ["run", "--set", f"rewards={{'{p['dir']}/boom.py:fn': 1}}"],
        ["boom.py", "no GPU here"],
    ),
    (
        "reward_no_attribute",
        lambda p: ["run", "--set", f"rewards={{'{p['dir']}/ok.py:nofn': 1}}"],
        ["nofn"],
    ),
    (
        "reward_signature",
        lambda p: ["run", "--set", f"rewards={{'{p['dir']}/sig.py:fn': 1}}"],
        ["sig.py:fn", "**kwargs"],
    ),
    ("reward_nan_weight", lambda p: ["run", "--set", "rewards={accuracy: .nan}"], ["accuracy"]),
    (
        "require_not_a_reward",
        lambda p: ["run", "--set", "rejection_sampling.require=[tag_count]"],
        ["rejection_sampling.require", "tag_count"],
    ),
    (
        "eval_reward",
        lambda p: ["run", "--set", "eval.accuracy_reward=acc"],
        ["eval.accuracy_reward"],
    ),
    (
        "sandbox_unavailable",  # code rewards, and no bubblewrap on PATH
        lambda p: ["run", "--set", "rewards={code_tests: 1}", "--set", "sandbox.isolation=bwrap"],
        ["sandbox.isolation", "bubblewrap is not installed"],
        {"PATH": "/nonexistent"},
    ),
    # data files
    ("data_missing", lambda p: ["run", *_files(p, rl="rl.jsonl-nope")], ["data.rl_path"]),
    ("data_no_prompt", lambda p: ["run", *_files(p, rl="rl_no_prompt")], ["row 1", "prompt"]),
    ("data_bad_json", lambda p: ["run", *_files(p, rl="rl_bad_json")], ["line 2", "JSON"]),
    (
        "data_prompt_type",
        lambda p: ["run", *_files(p, rl="rl_prompt_number")],
        ["row 0, field 'prompt'"],
    ),
    ("data_chat", lambda p: ["run", *_files(p, rl="rl_chat_no_content")], ["message 0"]),
    (
        "data_completion",
        lambda p: ["run", *_files(p, sft="sft_completion_list")],
        ["data.sft_path", "field 'completion'"],
    ),
    (
        "data_huge_prompt",
        lambda p: ["run", *_files(p, rl="rl_huge_prompt")],
        ["1,000,000 characters", "data.max_prompt_chars"],
    ),
    ("data_mixed_types", lambda p: ["run", *_files(p, rl="rl_mixed_types")], ["field 'answer'"]),
    ("data_no_answer", lambda p: ["run", *_files(p, rl="rl_no_answer")], ["'answer'", "rewards"]),
    ("data_reserved", lambda p: ["run", *_files(p, rl="rl_reserved")], ["'completions'"]),
    ("data_empty", lambda p: ["run", *_files(p, ev="empty")], ["data.eval_path", "no rows"]),
    ("data_txt", lambda p: ["run", *_files(p, rl="txt")], ["rl.txt", "unsupported"]),
    ("data_parquet", lambda p: ["run", *_files(p, rl="rl_trunc_parquet")], ["rl_trunc.parquet"]),
    # checkpoints
    (
        "model_missing",
        lambda p: ["run", "--set", "model.source=path", "--set", "model.path=/nonexistent/m"],
        ["model.path", "/nonexistent/m"],
    ),
    (
        "model_truncated",
        lambda p: ["run", "--set", "model.source=path", "--set", f"model.path={p['ck_truncated']}"],
        ["ck_trunc/model.safetensors", "truncated"],
    ),
    ("model_no_config", lambda p: ["rollout", "--policy", p["ck_no_config"]], ["config.json"]),
    ("model_bad_config", lambda p: ["eval", "--checkpoint", p["ck_bad_config"]], ["config.json"]),
    ("model_bad_header", lambda p: ["rollout", "--policy", p["ck_bad_header"]], ["header length"]),
    ("model_no_tokenizer", lambda p: ["rollout", "--policy", p["ck_no_tokenizer"]], ["tokenizer"]),
    ("model_no_weights", lambda p: ["rollout", "--policy", p["ck_no_weights"]], ["safetensors"]),
    # tracking store
    (
        "tracking_refused",
        lambda p: ["run", "--set", f"tracking.uri={p['refused_url']}"],
        ["tracking.uri", "no MLflow server answers"],
    ),
    (
        "tracking_no_answer",
        lambda p: ["run", "--set", f"tracking.uri={p['hole_url']}"],
        ["tracking.uri", "no answer within 5 s"],
    ),
    (
        "tracking_no_folder",
        lambda p: ["run", "--set", "tracking.uri=sqlite:////nonexistent/dir/m.db"],
        ["/nonexistent/dir", "does not exist"],
    ),
    (
        "tracking_not_sqlite",
        lambda p: ["run", "--set", f"tracking.uri=sqlite:///{p['not_sqlite']}"],
        ["notsqlite.db", "not an SQLite database"],
    ),
    (
        "tracking_read_only",
        lambda p: ["run", "--set", f"tracking.uri=sqlite:///{p['ro_db']}"],
        ["ro.db", "read-only"],
    ),
    # output folders
    (
        "output_read_only",
        lambda p: ["run", "--set", f"output_dir={p['ro_dir']}/runs"],
        ["output_dir", "read-only"],
    ),
    (
        "output_under_file",
        lambda p: ["run", "--set", f"output_dir={p['rl']}/runs"],
        ["rl.jsonl is a file"],
    ),
    ("run_name", lambda p: ["run", "--set", "run_name=../elsewhere"], ["run_name"]),
    # stage commands
    (
        "rollout_data",
        lambda p: ["rollout", "--policy", p["ckpt"], "--data", p["rl_no_prompt"]],
        ["--data", "row 1"],
    ),
    (
        "rollout_out_read_only",
        lambda p: ["rollout", "--policy", p["ckpt"], "--out", f"{p['ro_dir']}/r.parquet"],
        ["--out", "read-only"],
    ),
    (
        "score_truncated",
        lambda p: ["score", "--rollouts", p["rollouts_trunc"]],
        ["--rollouts", "Parquet"],
    ),
    ("score_columns", lambda p: ["score", "--rollouts", p["rollouts_no_ids"]], ["completion_ids"]),
    (  # every score would be None: the run would learn nothing, and exited 0
        "score_code_tests_without_tests",
        lambda p: ["score", "--rollouts", p["rollouts"], "--set", "rewards={code_tests: 1.0}"],
        ["--rollouts", "'test', 'test_list', 'tests'", "code_tests"],
    ),
    (
        "score_overwrite",
        lambda p: ["score", "--rollouts", p["rollouts"], "--out", p["rollouts"]],
        ["--out", "never rewrites"],
    ),
    (
        "update_out_of_vocab",
        lambda p: ["update", "--scored", p["scored_oov"], "--policy", p["ckpt"]],
        ["row 5", "'completion_ids'", "token id 99", "vocab_size"],
    ),
    (
        "update_other_tokenizer",
        lambda p: ["update", "--scored", p["scored_foreign"], "--policy", p["ckpt"]],
        ["another tokenizer", "0123456789abcdef"],
    ),
    (
        "update_same_size_tokenizer",
        lambda p: ["update", "--scored", p["scored_real"], "--policy", p["ck_swapped"]],
        ["real_scored.parquet", "another tokenizer", "ck_swapped"],
    ),
    # numbers that would crash mid-run, run on nothing, or hang (issue 44)
    (
        "rl_lr_inf",
        lambda p: ["run", "--set", "rl.learning_rate=inf"],
        ["rl.learning_rate", "finite"],
    ),
    ("sft_lr_inf", lambda p: ["run", "--set", "sft.learning_rate=inf"], ["sft.learning_rate"]),
    ("temperature_inf", lambda p: ["run", "--set", "rl.temperature=inf"], ["rl.temperature"]),
    (
        "reward_weight_huge",
        lambda p: ["run", "--set", "rewards={accuracy: 1.0e+308}"],
        ["rewards.accuracy", "overflow"],
    ),
    ("threads_zero", lambda p: ["run", "--set", "torch_threads=0"], ["torch_threads"]),
    (
        "num_generations_huge",
        lambda p: ["run", "--set", "rl.num_generations=100000000"],
        ["rl.num_generations=100000000", "GiB to hold", "lower them"],
    ),
    ("yaml_duplicate_key", lambda p: ["run", "--config", p["dup_yaml"]], ["'seed' twice"]),
    (
        "tracking_scheme",
        lambda p: ["run", "--set", "tracking.uri=mongodb://localhost/x"],
        ["tracking.uri", "unknown scheme 'mongodb'"],
    ),
    (
        "update_nan_advantage",
        lambda p: ["update", "--scored", p["scored_nan"], "--policy", p["ckpt"]],
        ["scored_nan.parquet, row 3, field 'advantage'", "nan"],
    ),
    (
        "update_null_advantage",
        lambda p: ["update", "--scored", p["scored_null"], "--policy", p["ckpt"]],
        ["row 3", "None"],
    ),
    (
        "update_no_rows",
        lambda p: ["update", "--scored", p["scored_empty"], "--policy", p["ckpt"]],
        ["scored_empty.parquet", "no rows"],
    ),
    (
        "update_no_advantage",
        lambda p: ["update", "--scored", p["scored_no_adv"], "--policy", p["ckpt"]],
        ["--scored", "advantage"],
    ),
    # the tool demo's environment settings (rollout.tools and its knobs)
    *[
        (f"tools_{name}", lambda p, o=override: ["run", "--config", TOOLS, "--set", o], expected)
        for name, override, expected in [
            ("typo", "rollout.tools=[pyhton]", ["rollout.tools", "'pyhton'"]),
            ("twice", "rollout.tools=[python, python]", ["rollout.tools", "one environment"]),
            ("no_file", "rollout.tools=[nope.py:make_env]", ["rollout.tools", "nope.py"]),
            ("no_module", "rollout.tools=[no_such_mod:make_env]", ["environment", "no_such_mod"]),
            ("huge_timeout", "rollout.tool_timeout_s=1e30", ["rollout.tool_timeout_s"]),
            ("tiny_timeout", "rollout.tool_timeout_s=1e-9", ["rollout.tool_timeout_s"]),
            ("huge_memory", "rollout.tool_memory_mb=1000000000000000", ["tool_memory_mb"]),
            ("over_ram", "rollout.tool_memory_mb=4000000", ["tool_memory_mb", "MiB"]),
            ("no_markers", "model.demo.vocabulary=addition", ["rollout.tool_call_start"]),
            ("unknown_marker", "rollout.tool_call_end=</call>", ["'</call>'", "vocabulary"]),
            ("same_markers", "rollout.tool_call_end=<tool_call>", ["tool_call_end"]),
            ("one_turn", "rollout.max_turns=1", ["rollout.max_turns=1"]),
            ("sft_mask", "sft.mask_spans=[[a, b]]", ["sft.mask_spans", "tool's output"]),
            ("empty_marker", 'sft.mask_spans=[["", "b"]]', ["sft.mask_spans", "non-empty"]),
        ]
    ],
    # function tools: the demo's chat template has no tools section; a missing function
    *[
        (f"functions_{name}", lambda p, o=override: ["run", "--set", o], expected)
        for name, override, expected in [
            ("no_template", "rollout.functions=[calculator]", ["template ignores tools"]),
            ("missing", "rollout.functions=[nope.py:f]", ["rollout.functions", "nope.py"]),
        ]
    ],
    *(  # where vLLM is installed (.ci/vllm.sh's venv) the run would start
        [("vllm_missing", lambda p: ["run", "--set", "rollout.engine=vllm"], ["vllm"])]
        if importlib.util.find_spec("vllm") is None
        else []
    ),
    (
        "eval_no_answer",
        lambda p: ["eval", "--checkpoint", p["ckpt"], "--data", p["rl_no_answer"]],
        ["--data", "'answer'", "eval.accuracy_reward"],
    ),
]


def _snapshot(*dirs: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for d in dirs:
        for path in d.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                st = path.stat()
                out[str(path)] = (st.st_size, st.st_mtime_ns)
            elif path.is_dir():
                out[str(path)] = (-1, 0)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_input_is_one_line_exit_2_and_writes_nothing(inputs, case):
    _, argv, expected, *extra_env = case
    work = inputs["work"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PYTHONPATH=str(ROOT),
        PREFECT_HOME=str(work / "prefect-home"),  # created if Prefect were ever started
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    env.pop("GRPO_DEBUG", None)
    env.update(*extra_env)
    cmd = [sys.executable, "-m", "flows.cli", *argv(inputs)]
    cmd[4:4] = ["--set", f"output_dir={work / 'runs'}"]  # a case's own --set comes later, wins
    before = _snapshot(work, Path(inputs["dir"]))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(lines) == 1 and lines[0].startswith("grpo: error: "), proc.stderr[-3000:]
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert proc.stdout == ""
    assert elapsed < 15, f"took {elapsed:.1f} s"
    assert _snapshot(work, Path(inputs["dir"])) == before, "something was written"
    assert not (work / "runs").exists() and not (work / "mlflow.db").exists()


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
