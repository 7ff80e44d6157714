"""The trainer a stage opens once: the one door to the policies this process holds, and the
one place an RL iteration's policy is made again.

The policies a process holds are its executor's (cluster/policies.py): the learner the stages
train (grpo_core/algorithm/learner.py) and models loaded read-only. A stage opens a
:class:`Trainer` on them (:func:`open_trainer`; flows/rl.py once per stage, the tasks it runs
the same way in their process) and asks it, by :class:`~tasks.policies.version.PolicyVersion`
or path:

- :meth:`Trainer.handle`: a policy to sample or read (rollouts, evals, the reference model,
  the final checkpoint): the learner's weights when they are the ones asked for, else the
  checkpoint on disk (a folder, or an iteration record's kept one; its background write
  finished first) loaded read-only. It never trains: a record whose weights are neither in
  memory nor kept is :class:`NotInMemory`.
- :meth:`Trainer.learner_at`: the learner holding a policy's weights, ready to train (the
  update and SFT tasks). This is where lineage is resolved: the learner when it holds them,
  else the nearest kept state loaded and the recorded updates replayed forward from it (on
  CPU, where the update is deterministic, bit for bit; the record's ``policy_id`` is
  checked). An update takes it through :meth:`Trainer.learner_for`, which also resumes the
  stage's optimizer.
- :meth:`Trainer.sampleable`: before a task samples a version that may be in neither place
  (a rerun whose cached updates left an iteration's weights unkept), its lineage resolved,
  so that the sampling tasks only ever take handles.

With ``model.lora``, a task that trains names the checkpoint its adapter sits on
(``lora_base``: the stage's initial checkpoint): the learner is that base with a LoRA
adapter (fresh at the stage's first step, else the checkpoint's ``adapter/``), and the
reference model is the same modules with the adapter disabled.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster import runtime
from grpo_core.errors import UserError
from tasks.policies import loading
from tasks.policies import ref as policy_ref
from tasks.run_log import logger


@dataclass(frozen=True)
class Handle:
    """A policy to sample or read, never to train: the weights in memory (shared with the
    learner when it holds them), tokenizer, id, and the checkpoint or record asked for."""

    checkpoint: Path
    policy_id: str
    model: Any
    tokenizer: Any

    @property
    def config(self):
        return self.model.config


class NotInMemory(LookupError):
    """The policy an RL iteration's record names is neither in memory nor kept on disk: only
    replaying its update gives it back (:func:`learner_at`)."""

    def __init__(self, path: Path, ref) -> None:
        why = "its background write did not finish" if ref.checkpoint else "not a save point"
        super().__init__(f"{path}: policy {ref.policy_id} is not in memory and has no kept "
                         f"checkpoint ({why})")  # fmt: skip
        self.path, self.ref, self.why = path, ref, why


def open_trainer(executor=None) -> Trainer:
    """A trainer on the policies ``executor`` (default: this process's,
    cluster/runtime.py) holds, as loaded with today's options."""
    executor = executor or runtime.executor()
    return Trainer(executor.policies)


class Trainer:
    """The policies one process holds (cluster/policies.py), asked for by version."""

    def __init__(self, policies) -> None:
        self.policies = policies

    def held(self):
        """The policies, as loaded with today's options (others are dropped)."""
        self.policies.drop_unless(loading.loading())
        return self.policies

    @property
    def stats(self) -> dict:
        """Loads from disk, hits and replays so far (tests and benchmarks read them)."""
        return self.policies.stats

    def handle(self, path: str | os.PathLike, slot: str = "policy") -> Handle:
        """``path``'s policy (a version, a checkpoint or a record) to sample or read
        (``slot``: ``"policy"``, or ``"reference"`` for an update's reference model, loaded
        beside the policy)."""
        at = policy_ref.locate(path)
        path, pid = at.path, at.policy_id
        policies = self.held()
        with policies.lock:
            learner = policies.learner
            got = learner if slot == "policy" and learner is not None else None
            if got is None or got.policy_id != pid:
                got = policies.loaded.get(slot)
            if got is not None and got.policy_id == pid:
                policies.stats["hits"] += 1
                return Handle(path, pid, got.model, got.tokenizer)
            got = self._load(at, slot)
            policies.loaded[slot] = got
            return Handle(path, pid, got.model, got.tokenizer)

    def _load(self, at: policy_ref.Located, slot: str, lora_base: Path | None = None):
        """``at``'s weights from disk as a fresh learner (with an adapter on ``lora_base``)."""
        from grpo_core.algorithm.learner import Learner, with_adapter

        path, pid = at.path, at.policy_id
        weights = path
        if at.record is not None:
            ref = at.record
            if ref.checkpoint and self.is_pending(ref.checkpoint):
                self.policies.learner.drain()  # its background write: finished before it is read
            weights = ref.kept()
            if weights is None:
                if slot != "policy":
                    raise UserError(f"{path}: a policy record is not a {slot} model; give a "
                                    "checkpoint")  # fmt: skip
                raise NotInMemory(path, ref)
        if lora_base is not None:
            base_id = policy_ref.policy_id(lora_base)
            if pid != base_id:
                _check_adapter(weights, lora_base, base_id)
            got = with_adapter(None, weights, pid, lora_base, base_id, **_lora_how())
        else:
            got = Learner.load(weights, pid, load=loading.load, loaded_with=loading.loading())
        got_id = policy_ref.policy_id(weights) if weights != path else pid
        if got_id != pid:
            raise UserError(f"{path}: records policy {pid} kept in {weights}, which holds "
                            f"{got_id}; rerun the stage with --force")  # fmt: skip
        got.checkpoint = path
        self.policies.stats["loads"] += 1
        logger(__name__).info("loaded %s (%s) from disk into slot %s", path, pid, slot)
        return got

    def learner_at(self, path: str | os.PathLike, *, lora_base: str | Path | None = None):
        """The learner, holding ``path``'s weights (a version, a checkpoint folder or an
        iteration's record), to train: in memory, else loaded, else replayed from the
        nearest kept state. ``lora_base`` (training with ``model.lora``): the checkpoint its
        adapter sits on."""
        at = policy_ref.locate(path)
        base = Path(lora_base) if lora_base is not None and loading.options().lora else None
        try:
            return self._learner(at, base)
        except NotInMemory as e:
            gone = e  # (the except clause's name is cleared when it ends)
        ref = gone.ref
        logger(__name__).info(
            "%s: policy %s is not in memory and has no kept checkpoint (%s): replaying the "
            "update of iteration %s from %s",
            at.path.parent.name, ref.policy_id, gone.why, ref.update.get("iteration"), ref.parent,
        )  # fmt: skip
        got = self._replay(ref)
        self.policies.stats["replays"] += 1
        if got != ref.policy_id:
            raise UserError(
                f"{at.path}: replaying iteration {ref.update.get('iteration')}'s update gave "
                f"policy {got}, but the run recorded {ref.policy_id}: the update is not "
                "deterministic here (GPU kernels, data-parallel ranks) or its inputs changed. "
                "Keep the train states such reruns start from (rl.save_steps: 1 and a larger "
                "rl.save_total_limit), or rerun the stage with --force"
            )
        return self._learner(at, base)

    def learner_for(self, path: str | os.PathLike, optimization, *, seed: int,
                    lora_base: str | Path | None = None, parallel=None):  # fmt: skip
        """:meth:`learner_at` ``path``, ready to train under ``parallel`` (this rank of N;
        default one process) with the train state of ``optimization`` (an
        ``RLOptimization``: the stage's optimizer at its step): the learner's when it is
        that state, else the one saved with ``path``'s weights (the checkpoint, or the
        record's kept one), else fresh (grpo_core/algorithm/learner.py: ``Learner.resume``).
        Returns the ``Learner``."""
        learner = self.learner_at(path, lora_base=lora_base)
        saved = policy_ref.saved_at(path) or Path(path)  # where a saved state would be
        learner.resume(optimization, saved, seed=seed, parallel=parallel,
                       logger=logger(__name__))  # fmt: skip
        return learner

    def _learner(self, at: policy_ref.Located, base: Path | None):
        path, pid = at.path, at.policy_id
        policies = self.held()
        with policies.lock:
            learner = policies.learner
            if learner is not None and learner.policy_id == pid:
                policies.stats["hits"] += 1
            else:
                if learner is not None:  # its kept checkpoints written before it goes
                    learner.drain()
                policies.learner = None  # a failed load leaves no learner of other weights
                loaded = policies.loaded.get("policy")
                if loaded is not None and loaded.policy_id == pid:
                    learner = policies.loaded.pop("policy")  # sampled read-only so far: trained
                    policies.stats["hits"] += 1
                else:
                    learner = self._load(at, "policy", lora_base=base)
            if base is not None:
                learner = _adapted(learner, at, base)
            learner.checkpoint = path
            policies.learner = learner
            return learner

    def _replay(self, ref) -> str:
        """Run again the update ``ref`` records (its scored file, from its parent policy,
        whose lineage this resolves in turn), writing nothing; the learner holds the new
        weights, named by the record. Returns their ``policy_id``."""
        from tasks.update import UpdateRequest, update_from_file

        args = ref.update
        out = update_from_file(UpdateRequest.replaying(args), keep=False, trainer=self)
        logger(__name__).info("%s iteration %d replayed from %s: policy %s", args["stage"],
                              args["iteration"], args["scored_path"], out.policy_id)  # fmt: skip
        return out.policy_id

    def sampleable(self, version: str | os.PathLike) -> None:
        """Make ``version`` something :meth:`handle` gives without training: nothing to do
        when its weights are in memory or on disk, else its lineage resolved into the
        learner."""
        at = policy_ref.locate(version)
        policies = self.held()
        in_memory = [policies.learner, policies.loaded.get("policy")]
        if not any(p is not None and p.policy_id == at.policy_id for p in in_memory):
            ref = at.record  # None: a checkpoint folder
            pending = ref is not None and ref.checkpoint and self.is_pending(ref.checkpoint)
            if ref is not None and ref.kept() is None and not pending:  # (pending: on disk soon)
                self.learner_at(at.path)

    def reference(self, learner, checkpoint: str | Path):
        """The reference model for an update of ``learner``: with LoRA on ``checkpoint``'s
        weights, the policy's own modules with the adapter disabled; else ``checkpoint``'s
        model (slot ``reference``)."""
        base_id = policy_ref.policy_id(checkpoint)
        return learner.reference(base_id, lambda: self.handle(checkpoint, slot="reference").model)

    def holding(self, policy_id: str):
        """The learner's model when its weights are ``policy_id``, else None."""
        return self.held().holding(policy_id)

    def drain(self) -> None:
        """The learner's queued checkpoint writes, finished (the end of a stage)."""
        self.held().drain()

    def is_pending(self, path: str | Path) -> bool:
        """Whether ``path`` is a checkpoint the learner's writer has yet to write."""
        learner = self.policies.learner
        return learner is not None and learner.writer.is_pending(path)

    def forget(self) -> None:
        """Hold no policy (as a new process would); queued writes finish first."""
        self.held().clear()

    def relabel(self, policy_id: str, path: str | os.PathLike) -> None:
        """Name ``path`` (a record, or a copy of the checkpoint) as where the learner's
        weights are, when they are ``policy_id``."""
        learner = self.policies.learner
        if learner is not None and learner.policy_id == policy_id:
            learner.checkpoint = Path(path)


def _adapted(learner, at: policy_ref.Located, base: Path):
    base_id = policy_ref.policy_id(base)
    if learner.lora_base_id == base_id:
        return learner
    weights = at.saved() or at.path
    if learner.policy_id != base_id:
        _check_adapter(weights, base, base_id)
    return learner.adapted(weights, base, base_id, **_lora_how())


def _lora_how() -> dict:
    cfg = loading.options()
    return dict(lora_cfg=cfg.lora, quantized=cfg.load_in_4bit, load=loading.load,
                loaded_with=loading.loading())  # fmt: skip


def _check_adapter(checkpoint: Path, base: Path, base_id: str) -> None:
    """``checkpoint`` carries the adapter ``model.lora`` continues, on ``base``."""
    from grpo_core.training import lora

    adapter = checkpoint / lora.ADAPTER_DIR
    try:
        info = json.loads((checkpoint / "checkpoint_info.json").read_text())
    except (OSError, ValueError):
        info = {}
    saved_base = info.get("lora_base_policy_id")
    if adapter.is_dir() and saved_base == base_id:
        return
    raise UserError(
        f"{checkpoint}: model.lora continues the adapter saved with the checkpoint on "
        f"its stage's initial checkpoint {base} (policy {base_id}), but the checkpoint "
        + (
            "has no adapter/ folder"
            if not adapter.is_dir()
            else f"has an adapter on policy {saved_base}"
        )
        + "; rerun the stage with --force, or train it without model.lora"
    )
