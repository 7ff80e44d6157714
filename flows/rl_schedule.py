"""``rl.async_level: k``: rollouts of later iterations run while the trainer updates.

The schedule is fixed, so a run is reproducible and resumable: with ``P_j`` the policy
after ``j`` updates (``P_0`` the stage's initial checkpoint), iteration ``i``'s rollouts are
sampled by ``P_max(0, i-k)`` (:func:`sampling_index`). ``k = 0`` is the on-policy loop. As
soon as an update produces ``P_j``, the rollouts it samples are submitted (iteration
``j + k``; at the stage's start, iterations ``0..k``), each followed by its scoring task
(it starts when the rollout file lands), and the trainer goes on with iteration ``j``'s
update on a file sampled earlier. A rollout whose file is already cached for that policy is
reused as in the on-policy loop, and needs no weights.

The engine runs elsewhere so that the two really overlap: locally in the engine process
(cluster/engine_process.py), which gets a snapshot of ``P_j``'s weights taken before the
next update starts; on Ray on the rollout replicas, which read ``P_j``'s checkpoint.

What it records per iteration (tasks/tracking/charts.py puts them under ``train/``):
``async/policy_lag`` (``i`` minus the index of the sampling policy), ``timing/trainer_wait_s``
(the trainer waiting for that iteration's scored file) and ``timing/engine_idle_s`` (the
engine process waiting between the previous request and this one); and for the stage
``async/trainer_idle_share`` and ``async/engine_idle_share`` of the loop's wall time.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


def sampling_index(iteration: int, k: int) -> int:
    """The number of updates behind the policy that samples ``iteration``'s rollouts."""
    return max(0, iteration - k)


def sampled_by(j: int, k: int, iterations: int) -> list[int]:
    """The iterations whose rollouts ``P_j`` samples."""
    return [i for i in range(iterations) if sampling_index(i, k) == j]


@dataclass
class Overlap:
    """The rollout and scoring runs in flight, for one stage.

    ``submit(it, policy)`` starts iteration ``it``'s rollout and scoring tasks sampled by
    ``policy`` and returns their two futures; ``cached(it, policy)`` says whether the
    rollout file is there already; ``executor.hold`` freezes the weights otherwise
    (``load()`` gives a handle on its weights)."""

    k: int
    iterations: int
    submit: Callable
    cached: Callable[[int, object], bool]
    executor: object
    load: Callable[[object], object]
    source: str
    pending: dict = field(default_factory=dict)  # it -> (rollout, score futures, pid, held)
    uses: Counter = field(default_factory=Counter)  # policy_id -> rollouts still to land
    waited: float = 0.0
    busy: list = field(default_factory=list)  # the engine's (start, end) per rollout sampled
    t0: float = field(default_factory=time.monotonic)

    def policy_known(self, j: int, policy) -> None:
        """``P_j`` (a ``PolicyVersion``: tasks/policies/version.py) exists: submit the
        rollouts it samples."""
        policy_id = policy.policy_id
        for it in sampled_by(j, self.k, self.iterations):
            if it in self.pending:
                continue
            held = not self.cached(it, policy)
            if held:  # to be sampled: the weights as they are now
                self.executor.hold(policy_id, lambda: self.load(policy), self.source)
                self.uses[policy_id] += 1
            roll, scored = self.submit(it, policy)
            self.pending[it] = (roll, scored, policy_id, held)

    def take(self, it: int):
        """Iteration ``it``'s rollout and scoring results, once both are done, and the
        numbers this iteration adds to the stage's curves."""
        roll_f, score_f, pid, held = self.pending.pop(it)
        t = time.monotonic()
        roll, scored = roll_f.result(), score_f.result()
        wait = time.monotonic() - t
        self.waited += wait
        idle = None
        if roll.engine_busy is not None:
            start = roll.engine_busy[0]
            before = [end for _, end in self.busy if end <= start]
            idle = start - max(before) if before else None
            self.busy.append(roll.engine_busy)
        if held:
            self.uses[pid] -= 1
            if self.uses[pid] == 0:
                self.executor.release(pid)
        extra = {"async/policy_lag": float(it - sampling_index(it, self.k))}
        extra["timing/trainer_wait_s"] = wait
        if idle is not None:
            extra["timing/engine_idle_s"] = max(0.0, idle)
        return roll, scored, extra

    def shares(self) -> dict:
        """The trainer's and the engine's idle shares of the loop's wall time so far."""
        wall = max(time.monotonic() - self.t0, 1e-9)
        out = {"async/trainer_idle_share": min(1.0, self.waited / wall)}
        if self.busy:
            out["async/engine_idle_share"] = max(0.0, 1 - sum(e - s for s, e in self.busy) / wall)
        return out

    def cancel(self) -> None:
        """Drop what is in flight (the stage failed); snapshots are freed."""
        for *_, pid, _ in self.pending.values():
            self.executor.release(pid)
        self.pending.clear()
