"""The multi-turn seam (grpo_core/engines/turns.py): one request type through every sampling path,
one turn loop above the engines, and a per-token loss mask from the sample through Parquet
into the update's batch. Today's episodes are one model turn: no mask, no extra columns."""

from __future__ import annotations

import pickle

import pyarrow.parquet as pq
import torch

from grpo_core.algorithm.scored_batch import ScoredRows
from grpo_core.contracts.io import write_parquet
from grpo_core.contracts.rollouts import rollout_table
from grpo_core.engines.generation import Sample, SamplingParams
from grpo_core.engines.hf import HFEngine
from grpo_core.engines.turns import SampleRequest, run_turns
from grpo_core.training.checkpoint import load_checkpoint
from tasks.score import score_file

ROWS = [{"prompt": "12+34=", "answer": "46"}, {"prompt": "5+6=", "answer": "11"}]


def test_a_request_carries_the_engine_spec_and_survives_pickling():
    params = SamplingParams(n=2, temperature=0.7, seed=3)
    spec = {"name": "vllm", "options": {"dtype": "float32"}, "check_sync": True}
    req = SampleRequest.of(spec, params, load_options={"dtype": "float32"}, desc="rl_1 it0")
    assert (req.engine, req.engine_options, req.check_sync) == ("vllm", {"dtype": "float32"}, True)
    assert pickle.loads(pickle.dumps(req)) == req  # crosses to the engine process and Ray
    shard = req.with_params(SamplingParams(n=2, seed=9))
    assert (shard.params.seed, shard.engine, shard.desc) == (9, "vllm", "rl_1 it0")


def test_one_turn_episodes_are_the_engines_samples_without_a_mask(tiny_checkpoint):
    model, tok = load_checkpoint(tiny_checkpoint)
    engine = HFEngine(model=model, tokenizer=tok)
    ids = [tok.encode(r["prompt"]) for r in ROWS]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=0)
    got = run_turns(engine, ids, params, desc="test", progress=False)
    want = engine.generate(ids, params, progress=False)
    assert [(s.completion_ids, s.logprobs) for s in got] == [
        (s.completion_ids, s.logprobs) for s in want
    ]
    assert all(s.loss_mask is None and s.turns is None for s in got)
    table = rollout_table(ROWS, ids, got, tok, policy_id="p", iteration=0)
    assert "loss_mask" not in table.column_names and "turns" not in table.column_names


def _samples() -> list[Sample]:
    """Two episodes per prompt; the first of each has 2 tokens an environment added."""
    out = []
    for p in range(2):
        for s in range(2):
            ids = [5 + s, 6, 7, 8, 9][: 3 + s + p]
            mask = [1, 0, 0] + [1] * (len(ids) - 3) if s == 0 else None
            turns = (
                [
                    {"role": "assistant", "start": 0, "end": 1},
                    {"role": "tool", "start": 1, "end": 3},
                    {"role": "assistant", "start": 3, "end": len(ids)},
                ]
                if s == 0
                else None
            )
            out.append(Sample(p, s, ids, [-0.5] * len(ids), "stop", mask, turns))
    return out


def test_the_loss_mask_goes_through_parquet_and_scoring_into_the_batch(tiny_checkpoint, tmp_path):
    _, tok = load_checkpoint(tiny_checkpoint)
    ids = [tok.encode(r["prompt"]) for r in ROWS]
    samples = _samples()
    table = rollout_table(ROWS, ids, samples, tok, policy_id="p", iteration=0)
    path = tmp_path / "rollouts.parquet"
    write_parquet(table, path)
    back = pq.read_table(path)
    assert back.column("loss_mask").to_pylist()[1] == [1] * len(samples[1].completion_ids)
    tool = back.column("turns").to_pylist()[0][1]
    assert (tool["role"], tool["start"], tool["end"]) == ("tool", 1, 3)

    scored = tmp_path / "scored.parquet"
    score_file(str(path), str(scored), {"format": 1.0})
    assert (
        pq.read_table(scored).column("loss_mask").to_pylist()
        == back.column("loss_mask").to_pylist()
    )
    batch = ScoredRows.read(str(scored)).batch(0, mask_truncated=False, sampling_logprobs=False)
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        want = torch.tensor(s.loss_mask or [1] * n, dtype=torch.float32)
        assert torch.equal(batch.completion_mask[i, :n], want)
        assert batch.completion_mask[i, n:].sum() == 0
