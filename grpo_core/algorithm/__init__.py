"""The GRPO algorithm: one iteration in the paper's order (``iteration.py``), the estimators of
advantages, the policy loss and KL, off-policy corrections, the update's optimizer steps and
micro-batches, rejection sampling and held-out evaluation metrics."""
