"""The held-out evaluation samples as the rollouts do: through
grpo_core/algorithm/iteration.py: ``sample_episodes`` with one ``SampleRequest`` (the eval's
params, the stage's engine and environment, each prompt's data row), run here or by the
executor's hook (``eval_run``), which the eval task honours."""

from __future__ import annotations

import pytest

from cluster import runtime
from grpo_core.algorithm.evaluation import evaluate
from grpo_core.config.engine import EngineSpec
from grpo_core.config.stages import EvalConfig
from grpo_core.contracts.io import write_jsonl
from grpo_core.engines.hf import HFEngine
from grpo_core.engines.turns import SampleRequest
from grpo_core.errors import UserError
from tasks.evaluate import evaluate_checkpoint
from tests.tools.test_env_reset import HINT, ROWS, SPEC


def test_the_run_hook_gets_the_eval_request_and_samples_as_the_engine_here(tiny_model):
    model, tok = tiny_model
    seen = []

    def run(prompt_ids, request):
        seen.append(request)
        return request.run(HFEngine(model, tok), prompt_ids, progress=False)

    base = SampleRequest(None, engine="hf", engine_options={"decode": "auto"}, desc="eval")
    kw = {"max_new_tokens": 6, "num_samples": 2, "seed": 3, "desc": "held out"}
    hooked = evaluate(model, tok, ROWS, request=base, tools=SPEC, run=run, **kw)
    here = evaluate(model, tok, ROWS, tools=SPEC, **kw)
    assert hooked == here
    (req,) = seen
    assert (req.params.n, req.params.temperature, req.params.seed) == (2, 1.0, 3)
    assert req.desc == "held out" and req.engine_options == {"decode": "auto"}
    assert req.tools == SPEC and req.rows == tuple(ROWS)  # the environment reads its row
    assert [r["prompt"] for r in hooked.table][::2] == ["12+34=" + HINT, "5+6="]


def test_the_eval_task_samples_with_the_executors_hook(tiny_checkpoint, tmp_path, monkeypatch):
    executor = runtime.executor()
    asked = []
    real = type(executor).eval_run

    def eval_run(self, policy, request):
        asked.append(request)
        return real(self, policy, request)

    monkeypatch.setattr(type(executor), "eval_run", eval_run)
    data = str(write_jsonl(ROWS, tmp_path / "e.jsonl"))
    cfg = EvalConfig(max_completion_length=6)
    plain = evaluate_checkpoint(str(tiny_checkpoint), data, cfg)  # hf: HF generate here
    tools = evaluate_checkpoint(str(tiny_checkpoint), data, cfg, engine=EngineSpec(tools=SPEC))
    assert [r.tools for r in asked] == [None, SPEC]
    assert [r["prompt"] for r in plain.samples] == ["12+34=", "5+6="]
    assert [r["prompt"] for r in tools.samples] == ["12+34=" + HINT, "5+6="]


def test_prompts_too_long_for_the_model_name_the_eval_setting(tiny_model):
    model, tok = tiny_model
    long = [{"prompt": "1+" * 400 + "1=", "answer": "401"}]
    with pytest.raises(UserError, match=r"held out, prompt 0: .* eval\.max_completion_length=8"):
        evaluate(model, tok, long, max_new_tokens=8, desc="held out")
