"""An RL iteration's policy record (tasks/policies/ref.py) with the task bodies on real files:
the weights between save points stay in memory, a process without them replays the updates
from the nearest kept state, and a record the replay does not reproduce is refused by name."""

from __future__ import annotations

import json

import pytest

from grpo_core.config.stages import RLConfig
from grpo_core.contracts.io import write_jsonl
from grpo_core.demo.task import make_splits
from grpo_core.errors import UserError
from grpo_core.training.checkpoint import policy_id
from grpo_core.training.weights_id import savable_state_dict, state_dict_id
from tasks.cache import content_hash
from tasks.policies.ref import read_ref
from tasks.policies.trainer import NotInMemory, open_trainer
from tasks.rollout import rollout
from tasks.score import score
from tasks.update import UpdateRequest, update
from tasks.workspace import Workspace

RL = RLConfig(
    prompts_per_iteration=4, num_generations=4, steps_per_generation=2, max_completion_length=8
)


def _iterations(tiny_checkpoint, ws: Workspace, data: str, keep: list[bool]) -> list[str]:
    policy, step, refs = str(tiny_checkpoint), 0, []
    for it, kept in enumerate(keep):
        roll = rollout.fn("rl_1", it, policy, data, str(ws.rollouts("rl_1", it)), RL, 0)
        sc = score.fn("rl_1", it, roll.path, str(ws.scored("rl_1", it)), {"format": 1.0}, RL)
        request = UpdateRequest(policy, sc.path, str(ws.iteration_checkpoint("rl_1", it)), RL,
                                init_checkpoint=str(tiny_checkpoint), stage="rl_1",
                                global_step=step)  # fmt: skip
        up = update.fn(request, it, ref_path=str(ws.policy_ref("rl_1", it)), keep=kept)
        policy, step = up.checkpoint, up.global_step
        refs.append(policy)
    open_trainer().drain()
    return refs


def test_policies_between_save_points_are_replayed_from_the_kept_state(tiny_checkpoint, tmp_path):
    ws = Workspace.create(tmp_path, "r")
    data = str(
        write_jsonl(make_splits(0, n_sft=4, n_rl=16, n_dev=2, n_eval=2).rl, tmp_path / "rl.jsonl")
    )
    refs = _iterations(tiny_checkpoint, ws, data, keep=[True, False, False])
    records = [read_ref(r) for r in refs]
    assert [r.kept() is not None for r in records] == [True, False, False]
    assert not ws.iteration_checkpoint("rl_1", 1).exists()  # nothing written between saves
    # the warm policy is the last update's, hashed in memory as the files would hash
    warm = open_trainer().handle(refs[-1])
    assert warm.policy_id == records[-1].policy_id == content_hash(refs[-1])
    assert state_dict_id(savable_state_dict(warm.model)) == records[-1].policy_id
    assert records[0].policy_id == policy_id(ws.iteration_checkpoint("rl_1", 0))

    open_trainer().forget()  # a new process: iteration 2's policy is replayed from iteration 0's
    with pytest.raises(NotInMemory):  # a handle never trains: it says it has none
        open_trainer().handle(refs[-1])
    replays = open_trainer().stats["replays"]
    again = open_trainer().learner_at(refs[-1])  # the learner resolves the lineage: replays
    assert open_trainer().stats["replays"] - replays == 2  # updates 1 and 2
    assert again.policy_id == records[-1].policy_id
    assert again.train is not None and again.train.global_step == records[-1].global_step

    body = json.loads(ws.policy_ref("rl_1", 2).read_text())
    body["policy_id"] = "0" * 16  # a record the update does not reproduce
    ws.policy_ref("rl_1", 2).write_text(json.dumps(body))
    open_trainer().forget()
    with pytest.raises(UserError, match=r"iter_0002.*gave policy .* but the run recorded 0{16}"):
        open_trainer().learner_at(refs[-1])
