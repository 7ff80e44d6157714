"""The turn loop: the one place above the engines where an episode is sampled, and the one
request every sampling path hands down.

:class:`SampleRequest` says what to sample (the ``SamplingParams``) and with what (the
engine's name and options, how the sampling copy of the policy loads, whether to probe the
weight sync, the progress bar's label, the environment: ``tools``). The rollout task and the
held-out evaluation build it once (grpo_core/algorithm/sampling.py: ``sample_episodes`` is the
call both make); the executor (cluster/executor.py), the local engine process
(cluster/engine_process.py) and the Ray rollout replicas (cluster/rollout_workers.py,
cluster/replica.py) pass it on unchanged, and whichever process holds the engine calls
:func:`run_turns`.

Without an environment an episode is one model turn: the engine's samples as they are
(``Sample.loss_mask`` and ``turns`` None: every token the model's). With one
(``rollout.tools``, grpo_core/engines/environments.py), token in, token out:

1. each episode opens (grpo_core/engines/openings.py: the environment's episode for its
   row, and what its ``reset()`` adds to the prompt, if anything; that episode then samples
   from its own prompt, recorded as ``Sample.prompt_ids``); the engine samples each
   episode's first turn, stopping at the call marker as at EOS;
2. a turn that ends with a call goes to the episode (its text), which answers with an
   observation; the observation is tokenised once and appended to the episode's ids, with
   loss mask 0 and log-prob 0 (the sampler's log-probs exist for model tokens only);
3. the next turn continues from the exact ids so far (prompt + every turn), never from a
   re-rendered conversation, until a turn ends without a call, ``rollout.max_turns`` model
   turns are done, or ``max_completion_length`` (the whole trajectory's budget) runs out
   (``finish_reason`` ``length``, as for a single turn); a later turn gives the engine
   each episode's budget left (``budgets``), so no episode samples past its own. An engine
   with a ``turn_cache()`` (the hf engine) keeps each episode's KV cache from one turn to
   the next, so a turn feeds only the tokens after it (grpo_core/engines/turn_cache.py); an episode's goes when it
   ends, all of it when the loop returns.

The tool calls run on one pool of ``rollout.tool_workers`` threads for the whole loop. By
default the next turn waits for every call of the turn before (one barrier per turn); with
``rollout.tool_wait_s`` it waits that long, then samples the episodes whose calls have
answered (if none has, it waits for the first answer), and a late episode joins a later
round while its call holds its worker (:meth:`_Episodes._rounds`). An engine that takes
requests between steps (vLLM's ``turn_stream``: grpo_core/engines/vllm_stream.py) is driven
per episode instead when ``tool_wait_s`` is set: each turn a request of its own, added as
soon as its episode may go on (:meth:`_Episodes._streamed`). Nothing here imports prefect,
mlflow or ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import time
from collections.abc import Mapping
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_core.contracts.observations import (
    call_turn,
    clip_observation,
    encode_mark,
    encode_observation,
    encode_tool_messages,
)
from grpo_core.engines.bounded import as_observation, call_guarded, call_within, clip_chars
from grpo_core.engines.environments import Observation, ToolSpec, environment, load_spec
from grpo_core.engines.openings import completion_budget, open_episodes
from grpo_core.engines.trajectory import Trajectory

if TYPE_CHECKING:
    from grpo_core.engines.generation import Sample, SamplingParams


@dataclass(frozen=True)
class SampleRequest:
    """What to sample and with which engine (picklable: it crosses to the engine process
    and the Ray replicas)."""

    params: SamplingParams
    engine: str = "hf"
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    # how a process that loads its own copy of the policy loads it (the run's model section)
    load_options: Mapping[str, Any] = field(default_factory=dict)
    check_sync: bool = False  # probe that the engine's weights are the trainer's
    desc: str = "rollout"
    tools: ToolSpec | None = None  # the environment; None: single-turn completions
    rows: tuple | None = None  # the prompts' data rows, for environments that read them
    # the model's positions (grpo_core/engines/context.py), which a prompt an environment's
    # reset() extended must fit (grpo_core/engines/openings.py); None: unknown
    context: int | None = None

    @classmethod
    def of(cls, spec, params: SamplingParams, *, load_options=None, desc: str):
        """The request for the stage's engine ``spec`` (grpo_core/config/engine.py:
        ``EngineSpec``, or its settings' dict)."""
        from grpo_core.config.engine import EngineSpec

        spec = EngineSpec.of(spec)
        return cls(
            params,
            engine=spec.name,
            engine_options=dict(spec.options),
            load_options=dict(load_options or {}),
            check_sync=spec.check_sync,
            desc=desc,
            tools=spec.tools,
        )

    def with_params(self, params: SamplingParams, desc: str | None = None) -> SampleRequest:
        return dataclasses.replace(self, params=params, desc=desc or self.desc)

    def shard(self, start: int, end: int, params: SamplingParams) -> SampleRequest:
        """The request for prompts ``start:end`` (a rollout replica's shard)."""
        rows = None if self.rows is None else self.rows[start:end]
        return dataclasses.replace(self, params=params, rows=rows)

    def run(self, engine, prompt_ids: list[list[int]], *, progress: bool) -> list[Sample]:
        """:func:`run_turns` of this request with ``engine``."""
        return run_turns(engine, prompt_ids, self.params, desc=self.desc, progress=progress,
                         tools=self.tools, rows=self.rows, context=self.context)  # fmt: skip


def run_turns(
    engine,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    *,
    desc: str,
    progress: bool,
    tools: ToolSpec | Mapping | None = None,
    rows=None,
    context: int | None = None,
) -> list[Sample]:
    """``params.n`` episodes per prompt with ``engine`` (anything with the rollout engines'
    ``generate`` and a ``tokenizer``), ordered by prompt then sample index. Without
    ``tools``, one model turn each: the engine's samples. With ``tools`` (a ``ToolSpec`` or
    its fields), the turn loop of this module's docstring; ``rows[i]`` is prompt i's data
    row, for the environment's episodes; ``context``: the model's positions, which an
    episode's prompt as its ``reset()`` extended it must fit (grpo_core/engines/openings.py)."""
    spec = load_spec(tools)
    if spec is None:
        return engine.generate(prompt_ids, params, desc=desc, progress=progress)
    return _Episodes(engine, spec, params, desc, progress, context=context).run(prompt_ids, rows)


@dataclass
class _Episodes:
    """One call's episodes, turn by turn."""

    engine: Any
    spec: ToolSpec
    params: SamplingParams
    desc: str
    progress: bool
    kept: Any = None  # the engine's TurnCache for this call's episodes, if it keeps one
    context: int | None = None  # the model's positions (None: unknown)
    marks: tuple | None = None  # the truncation mark's and result end marker's ids

    def run(self, prompt_ids: list[list[int]], rows) -> list[Sample]:
        env = environment(self.spec)
        # JSON calls (the functions environment): a turn ends at the end-of-turn token and
        # may hold several calls; else the call's end marker ends it
        extra = () if self.spec.json_calls else (self.spec.tool_call_end,)
        params = dataclasses.replace(self.params, stop=(*self.params.stop, *extra))
        n = params.n
        opens = open_episodes(env, prompt_ids, rows, n, self.engine.tokenizer, self.context)
        # the engine's store of each episode's KV cache across its turns (the hf engine's
        # turn_cache: grpo_core/engines/turn_cache.py), keyed by the episode's index
        self.kept = getattr(self.engine, "turn_cache", lambda: None)()
        try:
            return self._turns(prompt_ids, opens, params)
        finally:
            if self.kept is not None:
                self.kept.close()

    def _turns(self, prompt_ids, opens, params: SamplingParams) -> list[Sample]:
        stream = getattr(self.engine, "turn_stream", None)
        if self.spec.tool_wait_s is not None and stream is not None and self.kept is None:
            return self._streamed(prompt_ids, opens, params, stream)
        samples = self._first_turns(prompt_ids, opens, params)
        episodes = [
            Trajectory(o.ids, s.prompt_index, s.sample_index, o.episode,
                     completion_budget(o, params.max_new_tokens, self.context),
                     opened=o.prompt, key=i)
            for i, s in enumerate(samples)
            for o in [opens[s.prompt_index * params.n + s.sample_index]]
        ]  # fmt: skip
        with self._call_pool() as pool:
            self._rounds(list(zip(episodes, samples, strict=True)), params, pool)
        return [ep.sample() for ep in episodes]

    @contextlib.contextmanager
    def _call_pool(self):
        """The ``tool_workers`` threads the loop's calls run on. Leaving on an error: calls
        not started are dropped, and the error is not held up by a running one (the python
        tool's ends within tool_timeout_s)."""
        pool = ThreadPoolExecutor(max_workers=self.spec.tool_workers or os.cpu_count() or 1)
        ended = False
        try:
            yield pool
            ended = True
        finally:
            pool.shutdown(wait=ended, cancel_futures=True)

    def _streamed(self, prompt_ids, opens, params: SamplingParams, turn_stream) -> list[Sample]:
        """Per-episode scheduling, on an engine with a ``turn_stream`` (vLLM's continuous
        batching: grpo_core/engines/vllm_stream.py): every turn is a request of its own,
        added when its episode may go on (the first at once, a later one as soon as the
        episode's call answers) and taken back at the engine step that finishes it. Seeds
        are the barrier's when every episode takes every turn (turn ``t`` of episode
        ``key``: round ``t - 1``'s seed, the episode's index), so an episode's samples do
        not depend on when its calls answer."""
        n, plain = params.n, all(o.prompt is None for o in opens)
        episodes = [
            Trajectory(o.ids, i // n, i % n, o.episode,
                     completion_budget(o, params.max_new_tokens, self.context),
                     opened=o.prompt, key=i)
            for i, o in enumerate(opens)
        ]  # fmt: skip
        stream = turn_stream(self.desc, self.progress)
        try:
            with self._call_pool() as pool:
                self._stream(stream, episodes, prompt_ids if plain else None, params, pool)
        finally:
            stream.close()
        return [ep.sample() for ep in episodes]

    def _stream(self, stream, episodes, prompt_ids, params: SamplingParams, pool) -> None:
        """:meth:`_streamed`'s loop: every first turn into ``stream`` (of ``prompt_ids``
        where given, seeded as :meth:`_first_turns` seeds them, else of each episode's own
        prompt), then engine steps until no turn and no call is left."""
        calls = {}
        for ep in episodes:  # an episode without room samples one token, cut as in
            # _model_turn (it ends "length")
            first = dataclasses.replace(
                params, max_new_tokens=max(1, min(ep.left, params.max_new_tokens))
            )
            if prompt_ids is not None:
                stream.add(ep.key, prompt_ids[ep.prompt_index], first, ep.prompt_index,
                           ep.sample_index)  # fmt: skip
            else:
                stream.add(ep.key, ep.prompt, dataclasses.replace(first, n=1), ep.key)
        while stream.busy or calls:
            for key, s in stream.step() if stream.busy else ():
                text = self._model_turn(episodes[key], s)
                if text:
                    calls[pool.submit(self._step, (episodes[key], text))] = episodes[key]
            if calls and not stream.busy:  # nothing to sample: wait for an answer
                t0 = time.perf_counter()
                done, _ = wait(calls, return_when=FIRST_COMPLETED)
                min((calls[f] for f in done), key=lambda ep: ep.answered).stalled += (
                    time.perf_counter() - t0
                )
            for f in sorted((f for f in calls if f.done()), key=lambda f: calls[f].key):
                ep = calls.pop(f)
                if self._answer(ep, f.result()):
                    rnd = ep.model_turns  # the barrier's round of this turn
                    seed = None if params.seed is None else params.seed + 1_000_003 * rnd
                    nxt = dataclasses.replace(params, n=1, seed=seed, max_new_tokens=ep.left)
                    stream.add(ep.key, ep.prompt + ep.ids, nxt, ep.key)

    def _rounds(self, active, params: SamplingParams, pool) -> None:
        """Turn after turn until every episode has ended. Each round appends the model
        turns ``active`` sampled and starts their tool calls on ``pool``; the next round
        samples the episodes whose calls are answered: all of them (``tool_wait_s`` None,
        one barrier per turn), or those answered within ``tool_wait_s`` of the round's end
        (at least one), the late ones joining the round after their answer. Calls run
        while the next round samples."""
        wait_s, calls, rnd = self.spec.tool_wait_s, {}, 0
        while True:
            for ep, s in active:
                text = self._model_turn(ep, s)
                if text:
                    calls[pool.submit(self._step, (ep, text))] = ep
                elif self.kept is not None:  # the episode ended: its KV is not needed
                    self.kept.drop(ep.key)
            if not calls:
                return
            t0 = time.perf_counter()
            done, _ = wait(calls, timeout=wait_s, return_when=ALL_COMPLETED)
            if not done:  # every call is late: the first answer starts the round
                done, _ = wait(calls, return_when=FIRST_COMPLETED)
            # the wait's seconds go to the call the loop waited for: the last to answer
            max((calls[f] for f in done), key=lambda ep: ep.answered).stalled += (
                time.perf_counter() - t0
            )
            going = []
            for ep, obs in sorted(((calls.pop(f), f.result()) for f in done),
                                  key=lambda answer: answer[0].key):  # fmt: skip
                if self._answer(ep, obs):
                    going.append(ep)
                elif self.kept is not None:
                    self.kept.drop(ep.key)
            if not going:
                active = []
                continue
            rnd += 1
            seed = None if params.seed is None else params.seed + 1_000_003 * rnd
            nxt = dataclasses.replace(params, n=1, seed=seed,
                                      max_new_tokens=max(ep.left for ep in going))  # fmt: skip
            outs = self._generate(
                [ep.prompt + ep.ids for ep in going],
                nxt,
                [ep.key for ep in going],
                f"{self.desc} {_turn_label(going)}",
                budgets=[ep.left for ep in going],
            )
            active = list(zip(going, outs, strict=True))

    def _generate(self, contexts, params: SamplingParams, keys: list[int], desc: str,
                  budgets: list[int] | None = None):  # fmt: skip
        """The engine's samples of ``contexts`` (each ``params.n`` times), the samples'
        episodes ``keys`` when the engine keeps their KV; ``budgets``: each context's own
        most new tokens, where the engine takes them (else each episode's share over its
        own is cut: :meth:`_model_turn`)."""
        kw = {} if self.kept is None else {"turns": self.kept, "episodes": keys}
        if (
            budgets is not None
            and min(budgets) < params.max_new_tokens
            and _takes_budgets(self.engine)
        ):
            kw["budgets"] = budgets
        return self.engine.generate(contexts, params, desc=desc, progress=self.progress, **kw)

    def _first_turns(self, prompt_ids, opens, params: SamplingParams) -> list[Sample]:
        """Every episode's first turn: ``n`` samples of each prompt, or, where a ``reset``
        added to some prompts (grpo_core/engines/openings.py), one sample of each
        episode's own prompt (the same seeds: vLLM's child ``i`` of a prompt is seeded
        ``base + i``, the hf engine draws in the same order)."""
        keys = list(range(len(opens)))  # episode i: prompt i // n, sample i % n
        if all(o.prompt is None for o in opens):
            return self._generate(prompt_ids, params, keys, self.desc)
        n = params.n
        one = dataclasses.replace(params, n=1)
        outs = self._generate([o.ids for o in opens], one, keys, self.desc)
        return [
            dataclasses.replace(s, prompt_index=i // n, sample_index=i % n)
            for i, s in enumerate(outs)
        ]

    def _model_turn(self, ep: Trajectory, s) -> str | None:
        """Append the model's turn (within the budget); its text when it calls a tool and
        the episode may go on, else None (the episode is over)."""
        tok = self.engine.tokenizer
        ids = list(s.completion_ids[: ep.left])
        ep.add(
            "assistant",
            ids,
            list(s.logprobs[: len(ids)]),
            tok.decode(ids, skip_special_tokens=True),
            policy=None if s.policy_logprobs is None else list(s.policy_logprobs[: len(ids)]),
        )
        cut = len(ids) < len(s.completion_ids)
        ep.finish = "length" if cut else s.finish_reason
        if (
            cut
            or s.finish_reason != "stop"
            or ep.left <= 0
            or ep.model_turns >= self.spec.max_turns
        ):
            return None
        if self.spec.json_calls:  # the environment finds the calls (none: the episode ends)
            return tok.decode(ids, skip_special_tokens=False)
        return call_turn(tok, ids, self.spec.tool_call_end)

    def _step(self, call: tuple[Trajectory, str]) -> Observation | None:
        """The episode's answer to a turn; an environment that raises answers with its error
        (recorded in the turn, the episode goes on)."""
        ep, text = call
        start = time.perf_counter()
        try:
            if getattr(ep.env, "bounds_itself", False):  # the python tool, function tools
                value, error = call_guarded(lambda: ep.env.step(text))
            else:  # a user's environment: step() within one call's deadline
                value, error = call_within(
                    lambda: ep.env.step(text), self.spec.tool_timeout_s, "the environment's step()"
                )
            obs, error = (None, error) if error is not None else as_observation(value)
            if error is None:
                return obs
            body = f"{self.spec.tool_result_start}{error}{self.spec.tool_result_end}"
            return Observation(body, error, time.perf_counter() - start)
        finally:
            ep.answered = time.perf_counter()

    def _answer(self, ep: Trajectory, obs: Observation | None) -> bool:
        """Append the observation's tokens (within the budget); whether the episode goes
        on."""
        if obs is None:  # the environment ends the episode
            return False
        tok, spec = self.engine.tokenizer, self.spec
        if self.marks is None:  # the truncation mark and the result end marker, encoded
            self.marks = (encode_mark(tok, spec.tool_truncation_mark),
                          tok(spec.tool_result_end, add_special_tokens=False)["input_ids"])  # fmt: skip
        mark, end = self.marks
        limit = spec.max_tool_output_tokens
        if obs.messages is not None:  # tool messages, rendered by the chat template
            messages = [
                {**m, "content": clip_chars(str(m.get("content", "")), limit)} for m in obs.messages
            ]
            ids = encode_tool_messages(tok, messages, limit, mark)
        else:
            text = clip_chars(obs.text, limit, spec.tool_result_end)
            ids = encode_observation(tok, text, spec.tool_result_start, spec.tool_result_end)
            ids = clip_observation(ids, limit, mark, end)
        take = ids[: ep.left]
        text = tok.decode(take, skip_special_tokens=True)
        ep.add("tool", take, [0.0] * len(take), text, error=obs.error, seconds=obs.seconds,
               calls=obs.calls, failed=obs.failed)  # fmt: skip
        if len(take) < len(ids) or ep.left <= 0:
            ep.finish = "length"
            return False
        return True


def _turn_label(going: list[Trajectory]) -> str:
    """The progress bar's label of a round: the model turn(s) it samples."""
    turns = sorted({ep.model_turns + 1 for ep in going})
    return f"turn {turns[0]}" if len(turns) == 1 else f"turns {turns[0]}-{turns[-1]}"


def _takes_budgets(engine) -> bool:
    """Whether ``engine.generate`` takes per-sample ``budgets`` (the built-in engines do; an
    engine of the user's may not)."""
    try:
        params = inspect.signature(engine.generate).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "budgets" or p.kind is p.VAR_KEYWORD for p in params)
