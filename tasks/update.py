"""Update task: a scored Parquet (this run's, an older run's, anyone's) -> GRPO optimizer
steps on the policy -> a new checkpoint. Reference log-probs are recomputed from the token ids
in the file, so any scored file with the contract's columns will do; old log-probs too, unless
the file's own sampling log-probs are the same numbers (``rl.old_logprobs``,
grpo_core/logprobs/old.py)."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster import process, storage
from grpo_core.config.rl import update_unkeyed
from grpo_core.config.stages import RLConfig
from tasks.cache import cached, stage_key
from tasks.policies import loading
from tasks.policies import ref as policy_ref
from tasks.policies.ref import PolicyRef
from tasks.policies.trainer import open_trainer
from tasks.results import UpdateOutcome
from tasks.run_log import logger, pull

# RL settings that do not change an update's result, marked on their fields: its key leaves
# them out (the reward weights are in the scored file it reads)
UNKEYED = update_unkeyed(RLConfig)


@dataclass(frozen=True)
class UpdateRequest:
    """One GRPO update from a file: what makes its weights, and so what an iteration's
    policy record keeps to replay it (tasks/policies/ref.py). ``policy_path``: a checkpoint
    folder or an iteration's ``policy.json`` record."""

    policy_path: str
    scored_path: str
    out_checkpoint: str
    rl: RLConfig
    reference_checkpoint: str | None = None
    init_checkpoint: str | None = None
    stage: str = "offline"
    global_step: int = 0
    total_steps: int | None = None
    seed: int = 0

    def record(self, iteration: int, ref_path: str) -> dict:
        """The arguments a policy record keeps (its ``update``): all but where the weights
        went, the record's own path instead."""
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del body["out_checkpoint"]
        return {**body, "rl": self.rl.model_dump(), "iteration": iteration, "ref_path": ref_path}

    @property
    def init_policy(self) -> str:
        """The stage's first policy: ``init_checkpoint``, else the reference checkpoint, else
        the policy (the optimizer's identity; with ``model.lora``, the adapter's base)."""
        return self.init_checkpoint or self.reference_checkpoint or self.policy_path

    def optimization(self, *, sharded: bool = False):
        """The stage's optimizer at ``global_step`` (grpo_core/training/train_state.py:
        ``RLOptimization``; ``sharded``: its state keyed as FSDP2 ranks save it)."""
        from grpo_core.training.checkpoint import policy_id
        from grpo_core.training.train_state import RLOptimization

        init_policy_id = policy_id(self.init_policy)
        return RLOptimization.of(self.rl, stage=self.stage, init_policy_id=init_policy_id,
                                 global_step=self.global_step, total_steps=self.total_steps,
                                 sharded=sharded)  # fmt: skip

    @classmethod
    def replaying(cls, record: dict) -> UpdateRequest:
        """The request a policy record's ``update`` keeps, writing where the record is."""
        names = {f.name for f in dataclasses.fields(cls)} - {"out_checkpoint", "rl"}
        body = {k: record[k] for k in names}
        return cls(**body, out_checkpoint=record["ref_path"], rl=RLConfig(**record["rl"]))


def update_from_file(
    request: UpdateRequest,
    *,
    on_step=None,
    data_parallel=None,
    keep: bool = True,
    background: bool = False,
    trainer=None,
) -> UpdateOutcome:
    """GRPO steps on the request's ``scored_path`` from its ``policy_path``, saved to
    ``out_checkpoint`` with the trainer state (AdamW, LR schedule, RNG states, step) that the
    next iteration of the stage continues from. The learner (``trainer``, default this
    process's: tasks/policies/trainer.py ``Trainer.learner_for``, which resolves the
    policy's lineage and resumes the stage's optimizer) trains and keeps the new weights
    (grpo_core/algorithm/learner.py: ``Learner.save``).

    ``keep=False`` (between an RL stage's save points): nothing is written, the new weights
    stay in memory under ``out_checkpoint`` and their ``policy_id``. ``background``: one
    process's checkpoint is written by the learner's writer (the stage drains it);
    data-parallel ranks write every update's, synchronously.

    ``stage`` and ``init_checkpoint`` (the stage's first policy; default the reference
    checkpoint, else the policy) name the stage the optimizer belongs to: at ``global_step``
    0 it is fresh, later it is the state saved with ``policy_path`` by this stage.

    ``data_parallel`` (a ``grpo_core.training.distributed.DataParallel``): this is one rank of N that
    run the same call (``flows/ddp_update.py``); the update is the one-process update and
    rank 0 alone writes the checkpoint, which every rank returns once it exists.
    """
    from grpo_core.algorithm.scored_batch import ScoredRows

    r, rl = request, request.rl
    # a trainer rank on another node: the inputs this update reads that its node lacks
    pull(
        r.scored_path,
        r.policy_path,
        r.reference_checkpoint if rl.beta > 0 else None,
        r.init_policy if loading.options().lora is not None else None,  # the LoRA adapter's base
    )
    rows = ScoredRows.read(r.scored_path, dynamic_sampling=rl.dynamic_sampling)
    sharded = data_parallel is not None and data_parallel.sharded
    trainer = trainer or open_trainer()
    learner = trainer.learner_for(r.policy_path, r.optimization(sharded=sharded), seed=r.seed,
                                  lora_base=r.init_policy, parallel=data_parallel)  # fmt: skip
    reference = functools.partial(trainer.reference, learner, r.reference_checkpoint)
    out = learner.update(
        rows,
        rl,
        quantized=loading.options().load_in_4bit,
        reference=reference if rl.beta > 0 else None,
        on_step=on_step,
        parallel=data_parallel,
        logger=logger(__name__),
    )
    _say_once(f"engine importance-sampling correction {out.engine_correction[1]}")
    logger(__name__).debug("%s: old log-probs: %s (%s)", r.scored_path, *out.old_logprobs)
    info = {"scored": r.scored_path, "global_step": out.global_step}
    kept = keep or data_parallel is not None  # data-parallel ranks write every update's
    if kept:
        pid = learner.save(r.out_checkpoint, info=info, parallel=data_parallel,
                           background=background, on_done=storage.publish, fetch=pull)  # fmt: skip
    else:
        pid = learner.weights_id()  # hashed in memory, nothing written
    learner.trained(r.out_checkpoint, pid)
    return UpdateOutcome(r.out_checkpoint, out.global_step, out.history, out.seconds,
                        out.peak_memory_gib, policy_id=pid, kept=kept)  # fmt: skip


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """A decision the updates of a run make alike, logged the first time this process makes
    it (not once per iteration)."""
    if message not in _SAID:
        _SAID.add(message)
        logger(__name__).info(message)


def update_on_rank(data_parallel, model_options, **kwargs) -> UpdateOutcome:
    """One rank of the trainer group (a Ray actor): the run's model load options, then
    :func:`update_from_file` with this rank's ``data_parallel``."""
    process.load_policies_with(model_options)
    return update_from_file(**kwargs, data_parallel=data_parallel)


def run_update(request: UpdateRequest, *, iteration: int, **options) -> UpdateOutcome:
    """:func:`update_from_file` (``options``: its keywords) where this process's executor runs
    updates: here, or on every rank of the trainer group (``cluster.backend: ray``,
    cluster/trainer_group.py) with the run's model load options."""
    from cluster import runtime

    return runtime.executor().update(
        update_from_file,
        functools.partial(update_on_rank, model_options=loading.options()),
        {"request": request, **options},
        what=f"{request.stage} iteration {iteration} update",
        out_checkpoint=request.out_checkpoint,
    )


def update_key(
    rl: RLConfig,
    policy_path: str,
    scored_path: str,
    reference_checkpoint: str | None,
    *,
    global_step: int,
    total_steps: int | None,
    seed: int,
) -> str:
    """The update's cache key: the RL settings that change its result, where the stage is,
    and the contents of the policy, the scored file and (beta > 0) the reference."""
    knobs = rl.model_dump(exclude=UNKEYED)
    inputs = [policy_path, scored_path] + ([reference_checkpoint] if rl.beta > 0 else [])
    settings = {**knobs, "global_step": global_step, "total_steps": total_steps, "seed": seed}
    return stage_key("update", settings, inputs)


@task(name="update", task_run_name="{request.stage}-update-{iteration}", cache_policy=NO_CACHE)
def update(
    request: UpdateRequest,
    iteration: int,
    *,
    force: bool = False,
    ref_path: str | None = None,
    keep: bool = True,
) -> UpdateOutcome:
    """``request.init_checkpoint``: the stage's first policy (with ``stage``, the optimizer's
    identity: grpo_core/training/train_state.py: RLOptimization); ``seed`` seeds the RNGs at the stage's first step.

    ``ref_path`` (an RL stage's iteration): the update records its policy there
    (tasks/policies/ref.py) and that record is its cached output, whether the weights were
    written to ``out_checkpoint`` (``keep``: a save point) or stay in memory."""
    r = request
    key = update_key(r.rl, r.policy_path, r.scored_path, r.reference_checkpoint,
                     global_step=r.global_step, total_steps=r.total_steps, seed=r.seed)  # fmt: skip
    stage, out_checkpoint = r.stage, r.out_checkpoint

    def compute() -> UpdateOutcome:
        out = run_update(
            request,
            iteration=iteration,
            keep=keep,
            background=ref_path is not None,  # the stage drains the writer
        )
        last = out.history[-1] if out.history else {}
        logger(__name__).info(
            "%s iteration %d: %d steps, loss %.4f, %s %.3f, %.1fs, peak %.2f GiB",
            stage,
            iteration,
            len(out.history),
            last.get("loss", math.nan),
            # sharded ranks measure the trained rows only (grpo_core/training/parallel.py); nan: every
            # row of the last step was skipped and its entropy not measured
            *(
                ("entropy", last["entropy"])
                if "entropy" in last
                else ("entropy (trained rows)", last.get("entropy/trained_rows", math.nan))
            ),
            out.seconds,
            out.peak_memory_gib,
        )
        if ref_path is None:
            return out
        kept = out_checkpoint if out.kept else None
        ref = PolicyRef(out.policy_id, out.global_step, kept, r.record(iteration, ref_path))
        policy_ref.write_ref(ref_path, ref)
        open_trainer().relabel(
            out.policy_id, ref_path
        )  # the learner's weights, named by the record
        return dataclasses.replace(out, checkpoint=ref_path)

    output = ref_path or out_checkpoint
    return cached(f"{stage} iteration {iteration} update", output, key, compute, force=force)
