"""A process that samples the hostile factory environment's episodes on the vllm engine
(tests/engines/test_vllm_functions.py: ``CalcEnv``) and writes their ids as JSON; killed
by the test while a call is in flight.

    python -m tests.engines.vllm_kill_driver CHECKPOINT OUT.json"""

from __future__ import annotations

import sys

from grpo_core.config.tools import ToolSpec
from grpo_core.contracts.io import write_json
from grpo_core.contracts.text import row_prompt_ids
from grpo_core.engines import get_engine
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import run_turns
from tests.engines.test_vllm_functions import FACTORY, MODES, _rows
from tests.tools.test_json_tools import chat_tokenizer


def main(checkpoint: str, out: str) -> None:
    tok = chat_tokenizer()
    rows = [{**r, "mode": m} for r, m in zip(_rows([(14, 3)] * 4), MODES, strict=True)]
    prompts = [row_prompt_ids(tok, r) for r in rows]
    spec = ToolSpec(tools=("factory",), environment_factory=(("", FACTORY),), max_turns=2,
                    max_tool_output_tokens=40, tool_timeout_s=1.0)  # fmt: skip
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=120)
    engine = get_engine("vllm", checkpoint=checkpoint, dtype="float32", max_model_len=1024)
    try:
        got = run_turns(engine, prompts, greedy, desc="vllm", progress=False, tools=spec,
                        rows=rows)  # fmt: skip
    finally:
        engine.close()
    write_json([{"ids": e.completion_ids, "mask": e.loss_mask, "env": e.env} for e in got], out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
