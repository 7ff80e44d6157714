"""Where an RL stage's curves sit in the MLflow UI, and what their x-axis is.

MLflow's run page ("Model metrics") draws one section per key prefix (the key up to its last
``/``), the sections in alphabetical order, then the unprefixed keys ("Model metrics") and
"System metrics" last; charts inside a section are alphabetical too. An RL stage run
therefore logs:

- ``eval/<m>``: the held-out eval (``eval/accuracy`` first), the first section;
- ``train/<m>``: the headline training curves under TRL's names (``train/reward``,
  ``train/reward_std``, ``train/loss``, ``train/entropy``, ``train/kl``), the second;
- ``train/<group>/<m>``: TRL's grouped names (``clip_ratio/low_mean`` becomes
  ``train/clip_ratio/low_mean``; ``completions/``, ``rewards/<fn>/``, ``timing/``) below;
- ``train/more/<m>``: TRL's other flat names (``grad_norm``, ``learning_rate``,
  ``frac_reward_zero_std``, ``policy_loss``, ...), kept out of the headline section.

The step of every point is the number of RL iterations done: step 0 is the starting
checkpoint's eval, step ``k`` iteration ``k - 1``'s rollouts, scores and updates and the eval
of the weights it produced. An iteration's optimizer steps are averaged into its point
(:func:`iteration_means`); the per-step curves stay in the stage's nested iteration runs
under ``train/by_step/<m>`` (x-axis: optimizer steps).
"""

from __future__ import annotations

HEADLINE = ("reward", "reward_std", "loss", "entropy", "kl")
LAST = ("learning_rate",)  # the value at the iteration's last optimizer step
PEAK = ("peak_memory_gib",)  # the iteration's largest


def chart_key(name: str) -> str:
    """An RL stage run's MLflow key for metric ``name`` (TRL's name, as the code computes it)."""
    if name.startswith(("eval/", "train/", "system/")):
        return name
    if name in HEADLINE or "/" in name:
        return f"train/{name}"
    return f"train/more/{name}"


def chart_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` under their chart keys, headline curves first."""
    out = {chart_key(k): metrics[k] for k in HEADLINE if k in metrics}
    out.update({chart_key(k): v for k, v in metrics.items() if k not in HEADLINE})
    return out


def eval_point(metrics: dict[str, float]) -> dict[str, float]:
    """A held-out eval's numbers (``EvalOutcome.summary_metrics``) under ``eval/<m>``: the
    keys every run that shows an eval logs them under (RL and SFT stages, the parent run)."""
    return {f"eval/{k}": v for k, v in metrics.items()}


def step_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """One optimizer step's metrics as the nested iteration runs log them."""
    return {f"train/by_step/{k}": v for k, v in metrics.items()}


def iteration_means(history: list[dict]) -> dict[str, float]:
    """An iteration's optimizer steps in one point: the mean of each metric over the steps
    that report it (the learning rate: its last value; peak memory: its largest)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for h in history for k in h):
        values = [float(h[key]) for h in history if isinstance(h.get(key), int | float)]
        if not values:
            continue
        if key in LAST:
            out[key] = values[-1]
        elif key in PEAK:
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def pipeline_stage_key(index: int, stage: str, metric: str) -> str:
    """A pipeline parent run's key for one stage's number (its final held-out ``accuracy``,
    its ``wall_time_s``): ``stages/2_rl_1/accuracy``. These sections come after the parent's
    ``eval/*`` progression (one step per stage), numbered in recipe order."""
    return f"stages/{index + 1}_{stage}/{metric}"
