"""The cluster layer: Ray worker groups (rollout replicas, trainer group, scoring pool) used by
``tasks/`` when ``cluster.backend: ray``. ``grpo_core`` never imports it; with the default
``cluster.backend: local`` nothing of Ray is imported (docs/cluster.md)."""
