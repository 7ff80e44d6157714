"""What a process sets up before it runs anything of a config, done once and in one place.

Every entry point opens the run context of its config: ``grpo run`` and the deployments
(flows/r1.py: ``run_pipeline``), the stage commands and flows (flows/stages.py), the
data-parallel update's ranks (flows/ddp_update.py) and the benchmarks. Opening it:

- creates the run folder (``Workspace.create``: the ``.grpo-run`` marker);
- sets the process up (cluster/process.py, the one place of that state): its shared store
  at ``storage.url`` (cluster/storage.py), how policies are loaded (``model.dtype``,
  ``model.lora``, ...: tasks/policies/loading.py) and where rollouts, scoring and updates run
  (``cluster.backend``: cluster/runtime.py);
- sets the code sandbox's isolation when the config names one (the code rewards of this
  process and of the processes it starts read ``GRPO_SANDBOX_ISOLATION``);
- sets torch's thread count when ``torch_threads`` is given.

Nothing else configures the process: loading a config, naming its workspace
(``PipelineConfig.run_folder``) and the tasks themselves have no side effects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flows.config import PipelineConfig
from tasks.workspace import Workspace


@dataclass(frozen=True)
class RunContext:
    cfg: PipelineConfig
    workspace: Workspace

    @classmethod
    def open(cls, cfg: PipelineConfig) -> RunContext:
        from cluster import process

        ws = Workspace.create(cfg.output_dir, cfg.run_name)
        url = cfg.storage.url and f"{cfg.storage.url.rstrip('/')}/{cfg.run_name}"
        process.set_up(
            cluster=cfg.cluster,
            model=cfg.model,
            store_url=url,
            local=ws.root,
            store_options=cfg.storage.options,
        )
        if "sandbox" in cfg.model_fields_set:
            from grpo_core.sandbox.isolation import ISOLATION_ENV

            os.environ[ISOLATION_ENV] = cfg.sandbox.isolation
        if cfg.torch_threads:
            import torch

            torch.set_num_threads(cfg.torch_threads)
        return cls(cfg, ws)
