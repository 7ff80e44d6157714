"""The vllm engine's turns one request at a time: the turn loop's per-episode scheduling
(``rollout.tool_wait_s`` set, grpo_core/engines/turns.py).

Without a barrier the turn loop hands each model turn to the running engine as its own request
the moment the episode may go on (its first turn at the start, a later one as soon as its tool
call answers) and takes each turn back as soon as vLLM finishes it, one engine step at a time
(``LLMEngine.add_request`` / ``step``, the calls ``LLM.generate`` makes itself). The engine's
continuous batching then schedules the episodes: a turn joins the running batch at the next
step, no episode waits for another's call, and tool calls run while the others decode.

Each request is seeded on its own, as :meth:`VLLMEngine.generate` seeds a prompt's samples
(``prompt_seed(seed, index, n) + child``): an episode's turn is sampled from its own seed,
whatever else shares the engine's batch when it runs.
"""

from __future__ import annotations

import dataclasses
import itertools

from tqdm.auto import tqdm

from grpo_core.engines.generation import Sample, SamplingParams
from grpo_core.engines.vllm_engine import (
    _import_vllm,
    _reason,
    _sampled_logprobs,
    prompt_seed,
)

_IDS = itertools.count()  # request ids unique in the process: "turn-<n>"


def _final_only():
    return __import__(
        "vllm.sampling_params", fromlist=["RequestOutputKind"]
    ).RequestOutputKind.FINAL_ONLY


class TurnStream:
    """The turns of one call's episodes on ``engine`` (a :class:`VLLMEngine`): :meth:`add` a
    turn, :meth:`step` the engine, :meth:`close` at the end (aborts what is left)."""

    def __init__(self, engine, desc: str = "turns", progress: bool = True) -> None:
        self.engine = engine
        self.core = engine.llm.llm_engine
        self.render = getattr(engine.llm, "_preprocess_cmpl_one", None)
        self.open: dict[str, int] = {}  # request id -> the episode's key
        self.bar = tqdm(total=0, desc=desc, unit="turn", disable=not progress)

    @property
    def busy(self) -> bool:
        """Whether a turn is still being sampled."""
        return bool(self.open)

    def add(self, key: int, ids: list[int], params: SamplingParams, index: int,
            child: int = 0) -> None:  # fmt: skip
        """Sample one turn of episode ``key`` after ``ids``, at most ``params.max_new_tokens``
        tokens, seeded as sample ``child`` of prompt ``index`` of an ``n = params.n`` batch
        of :meth:`VLLMEngine.generate` (one sample: the request's ``n`` is 1)."""
        vllm = _import_vllm()
        seed = prompt_seed(params.seed, index, params.n)
        one = dataclasses.replace(params, n=1)
        sp = self.engine._sampling_params(one, None if seed is None else seed + child)
        sp.output_kind = _final_only()  # one output per request, when it is finished
        prompt = vllm.TokensPrompt(prompt_token_ids=list(ids))
        if self.render is not None:  # as LLM.generate renders it (else vLLM warns, once)
            prompt = self.render(prompt)
        rid = f"turn-{next(_IDS)}"
        self.core.add_request(rid, prompt, sp, lora_request=self.engine.lora_request)
        self.open[rid] = key
        self.bar.total += 1  # shown at the next update (a refresh per turn floods a log)

    def step(self) -> list[tuple[int, Sample]]:
        """One engine step; the turns it finished, with their episodes' keys."""
        done = []
        for out in self.core.step():
            if not out.finished or out.request_id not in self.open:
                continue
            c = out.outputs[0]
            ids = list(c.token_ids)
            sample = Sample(0, 0, ids, _sampled_logprobs(c.logprobs, ids), _reason(c))
            done.append((self.open.pop(out.request_id), sample))
        self.bar.update(len(done))
        return done

    def close(self) -> None:
        """Abort the turns still running (the loop left on an error) and close the bar."""
        if self.open:
            self.core.abort_request(list(self.open))
            self.open.clear()
        self.bar.close()
        self.engine._drop_old_adapters()
