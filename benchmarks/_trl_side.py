"""TRL's side of benchmarks/bench_vs_trl.py, one child process per call.

    python benchmarks/_trl_side.py --config C --set ... --start START.json --run-dir D --out F

``trl.GRPOTrainer`` from the same `cold_start_sft` checkpoint, on the prompts our rl_1 stage
draws, in the same order (our ``select_prompts`` per iteration, ``shuffle_dataset=False``),
as text after our chat template (what our rollout feeds the model), with our accuracy and
format reward functions (TRL's signature) and the config's `rl` knobs under TRL's names.
Only ``trainer.train()`` is timed; generation (``_generate``), rewards
(``_calculate_rewards``), forward/backward (``training_step``) and the optimizer step (the
callback's ``on_pre_optimizer_step`` .. ``on_optimizer_step``) are timed inside it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import (  # noqa: E402
    heldout_accuracy,
    load,
    peak_rss_mib,
    set_threads,
    side_args,
    write_result,
)


class Clock:
    """Seconds spent inside wrapped methods, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, obj, method: str, name: str) -> None:
        inner = getattr(obj, method)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - t0)

        setattr(obj, method, timed)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1


def training_prompts(cfg, start: dict, tokenizer) -> list[dict]:
    """The rows rl_1 would draw, iteration after iteration, with ``prompt`` as the text our
    rollout tokenizes (the chat template applied, generation prompt appended)."""
    from grpo_core.contracts.prompts import load_rows
    from grpo_core.contracts.text import encode_prompt, prompt_text
    from tasks.rollout import select_prompts

    rows = load_rows(start["rl"])
    out = []
    for it in range(cfg.rl.iterations):
        for i in select_prompts(len(rows), cfg.rl.prompts_per_iteration, it, cfg.seed, "rl_1"):
            row = dict(rows[i])
            text = prompt_text(tokenizer, row["prompt"])
            # TRL tokenizes a text prompt with the tokenizer's special tokens; ours without
            if tokenizer(text)["input_ids"] != encode_prompt(tokenizer, row["prompt"]):
                raise SystemExit(
                    f"{start['rl']} row {i}: TRL would tokenize the prompt differently"
                )
            row["prompt"] = text
            out.append(row)
    return out


def grpo_config(cfg, run_dir: str):
    from trl import GRPOConfig

    rl = cfg.rl
    gen_batch = rl.prompts_per_iteration * rl.num_generations
    return GRPOConfig(
        output_dir=run_dir,
        num_generations=rl.num_generations,
        # generation_batch_size = per_device_train_batch_size x steps_per_generation (TRL
        # refuses both set at once)
        per_device_train_batch_size=gen_batch // rl.steps_per_generation,
        steps_per_generation=rl.steps_per_generation,
        gradient_accumulation_steps=rl.gradient_accumulation_steps,
        num_iterations=rl.num_iterations,
        max_steps=rl.iterations * rl.steps_per_generation // rl.gradient_accumulation_steps,
        max_completion_length=rl.max_completion_length,
        learning_rate=rl.learning_rate,
        lr_scheduler_type=rl.lr_scheduler_type,
        warmup_steps=rl.warmup_steps,
        weight_decay=rl.weight_decay,
        max_grad_norm=rl.max_grad_norm,
        optim=rl.optim,
        loss_type=rl.loss_type,
        beta=rl.beta,
        epsilon=rl.epsilon,
        epsilon_high=rl.epsilon_high,
        scale_rewards=rl.scale_rewards,
        importance_sampling_level=rl.importance_sampling_level,
        mask_truncated_completions=rl.mask_truncated_completions,
        disable_dropout=rl.disable_dropout,
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=rl.top_k,
        min_p=rl.min_p or None,
        repetition_penalty=rl.repetition_penalty,
        reward_weights=list(cfg.rewards.values()),
        multi_objective_aggregation=rl.multi_objective_aggregation,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        seed=cfg.seed,
        shuffle_dataset=False,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


def _optimizer_clock(clock: Clock):
    """A trainer callback that adds each optimizer step's seconds to ``clock``."""
    from transformers import TrainerCallback

    class OptimizerClock(TrainerCallback):
        t0 = 0.0

        def on_pre_optimizer_step(self, *a, **kw):
            OptimizerClock.t0 = time.perf_counter()

        def on_optimizer_step(self, *a, **kw):
            clock.add("optimizer", time.perf_counter() - OptimizerClock.t0)

    return OptimizerClock()


def _instrument(trainer, clock: Clock, num_generations: int) -> tuple[list[str], dict]:
    """Time the trainer's generation, rewards and training steps on ``clock``. Returns the
    prompts of each generation batch (once per group) and the completion-token count, both
    filled in as the trainer runs."""
    seen: list[str] = []
    generate = trainer._generate

    def recorded(prompts, *a, **kw):
        seen.extend(prompts[::num_generations])
        return generate(prompts, *a, **kw)

    trainer._generate = recorded
    clock.wrap(trainer, "_generate", "generation")
    clock.wrap(trainer, "_calculate_rewards", "score")
    clock.wrap(trainer, "training_step", "training_step")
    tokens = {"completion": 0}
    inner_prepare = trainer._generate_and_score_completions

    def count(*a, **kw):
        out = inner_prepare(*a, **kw)
        tokens["completion"] += int(out["completion_mask"].sum())
        return out

    trainer._generate_and_score_completions = count
    return seen, tokens


def _phase_seconds(clock: Clock, wall: float) -> dict[str, float]:
    s = clock.seconds
    gen, score = s.get("generation", 0.0), s.get("score", 0.0)
    # training_step holds generation and scoring (every steps_per_generation steps), the
    # old log-probs, the loss and backward; the optimizer step is outside it
    update = s.get("training_step", 0.0) - gen - score + s.get("optimizer", 0.0)
    return {
        "wall_s": wall,
        "generation_s": gen,
        "score_s": score,
        "update_s": update,
        "other_s": wall - gen - score - update,
    }


def main() -> None:
    args = side_args(__doc__.split("\n\n")[0])
    cfg = load(args.config, args.set)
    start = json.loads(Path(args.start).read_text())
    from flows.env import apply_defaults

    apply_defaults(args.run_dir, flow_logs=False)
    set_threads(args.threads)
    import datasets
    from trl import GRPOTrainer

    from grpo_core import rewards
    from grpo_core.training.checkpoint import load_checkpoint

    model, tokenizer = load_checkpoint(start["checkpoint"])
    rows = training_prompts(cfg, start, tokenizer)
    funcs = [rewards.get(name) for name in cfg.rewards]
    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=grpo_config(cfg, args.run_dir),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[_optimizer_clock(clock)],
    )
    seen, tokens = _instrument(trainer, clock, cfg.rl.num_generations)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rss = peak_rss_mib()
    acc = heldout_accuracy(trainer.model, tokenizer, cfg, start["eval"])
    write_result(
        args.out,
        {
            "side": "trl",
            "seed": cfg.seed,
            **_phase_seconds(clock, wall),
            "completion_tokens": tokens["completion"],
            "trained_tokens": tokens["completion"],
            "optimizer_steps": trainer.state.global_step,
            "peak_rss_mib": rss,
            # TRL sampled the prompts rl_1 draws, in its order
            "same_prompts": seen == [r["prompt"] for r in rows],
            **acc,
        },
    )


if __name__ == "__main__":
    main()
