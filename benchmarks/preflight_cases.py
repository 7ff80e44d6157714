"""The malformed-input cases of the pre-flight check (flows/preflight/) and how one is run:
each is a ``grpo`` command line that must be refused before Prefect starts, as exactly one
line on stderr naming the culprit, exit code 2, no traceback, nothing written.
``run_case`` runs one as a fresh process; ``problems`` says what about its outcome is wrong.
Checked by tests/pipeline/test_fail_fast.py (``CASES``) and tests/tools/test_tool_preflight.py
(``TOOL_CASES``); timed by benchmarks/bench_preflight.py (both)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    # the python tool on a checkpoint whose vocabulary has no tool markers (the stage
    # commands check the markers against the checkpoint's tokenizer, not the run's model)
    (
        "rollout_tools_no_markers",
        lambda p: ["rollout", "--policy", p["ckpt"], "--set", "rollout.tools=[python]"],
        ["rollout.tool_call_start", "vocabulary"],
    ),
    (
        "eval_tools_no_markers",
        lambda p: ["eval", "--checkpoint", p["ckpt"], "--set", "rollout.tools=[python]"],
        ["rollout.tool_call_start", "vocabulary"],
    ),
]


# the tool demo's environment settings (rollout.tools and its knobs), and function tools
TOOL_CASES = [
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
            (
                "unspelled_mark",
                "rollout.tool_truncation_mark=...(truncated)",
                ["rollout.tool_truncation_mark", "vocabulary"],
            ),  # fmt: skip
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
]


@dataclass
class Outcome:
    """What one ``grpo`` command did: exit code, output, wall seconds, and the paths it
    created or changed under the watched folders."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    written: list[str] = field(default_factory=list)


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


def run_case(case, inputs: dict, timeout: float = 60) -> Outcome:
    """Run ``case``'s command line on ``inputs`` (write_inputs' map; ``work`` and ``dir``
    are watched for writes) as a fresh ``python -m flows.cli`` in ``work``, with Prefect's
    home inside it, no proxy for loopback, no GRPO_DEBUG, and the case's own environment."""
    _, argv, _, *extra_env = case
    work = Path(inputs["work"])
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
    watched = [work, Path(inputs["dir"])]
    before = _snapshot(*watched)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - t0
    after = _snapshot(*watched)
    written = sorted(k for k in after.keys() | before.keys() if after.get(k) != before.get(k))
    return Outcome(proc.returncode, proc.stdout, proc.stderr, seconds, written)


def problems(case, out: Outcome) -> list[str]:
    """What about ``out`` is not the refusal ``case`` expects (empty: refused as it should
    be): exit code 2, no traceback, nothing on stdout, one ``grpo: error:`` line on stderr
    containing each expected substring, nothing written (no run folder, no MLflow store)."""
    expected = case[2]
    lines = out.stderr.strip().splitlines()
    found = []
    if out.returncode != 2:
        found.append(f"exit code {out.returncode}, not 2")
    if "Traceback" in out.stderr + out.stdout:
        found.append("a traceback")
    if out.stdout:
        found.append(f"stdout: {out.stdout[-500:]!r}")
    if len(lines) != 1 or not lines[0].startswith("grpo: error: "):
        found.append(f"{len(lines)} lines on stderr, not one 'grpo: error:' line")
    else:
        found += [f"{text!r} not in the line" for text in expected if text not in lines[0]]
    if out.written:
        found.append(f"wrote {out.written[:5]}")
    return found
