"""LoRA and QLoRA through ``peft``: attach an adapter, use the base with the adapter disabled
as the reference model (no second copy in memory), and build the merged weights that
checkpoints, ``from_pretrained`` and rollout engines get.

A LoRA checkpoint is a ``save_pretrained`` directory of the merged weights (what every
downstream stage and tool loads) with the adapter in ``adapter/`` (``adapter_config.json`` and
``adapter_model.safetensors``, what ``PeftModel.from_pretrained`` loads on the base), and its
``checkpoint_info.json`` names the base the adapter sits on (``lora_base``,
``lora_base_policy_id``). The adapter is in a sub-folder so that ``from_pretrained`` of the
checkpoint loads the merged model instead of following the adapter to its base.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from grpo_core.config.stages import LoraConfig

ADAPTER_DIR = "adapter"
ADAPTER_SEED = 0  # adapters start from the same draw every time: reruns and resumes agree


def _peft():
    try:
        import peft
    except ImportError as e:  # pragma: no cover - an install problem
        raise ImportError("model.lora needs peft: pip install 'grpo-pipeline[lora]'") from e
    return peft


def is_peft(model) -> bool:
    import sys

    # a PeftModel exists only once peft is imported: no import (about 0.5 s) just to check
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def attach_adapter(model, cfg: LoraConfig, *, quantized: bool = False):
    """A fresh trainable LoRA adapter on ``model`` (a ``PeftModel``; the base weights are
    frozen). The adapter's initial draw is seeded (``ADAPTER_SEED``) without touching the
    global RNG, so a stage resumed from its init checkpoint starts from the same adapter."""
    import torch

    peft = _peft()
    if quantized:
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=bool(getattr(model, "is_gradient_checkpointing", 0))
        )
    lcfg = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ADAPTER_SEED)
        return peft.get_peft_model(model, lcfg)


def load_adapter(base, adapter_dir: str | Path, *, trainable: bool = True):
    """``PeftModel.from_pretrained(base, adapter_dir)``, trainable by default."""
    peft = _peft()
    return peft.PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)


def merge_in_place(model):
    """The plain model with the adapter merged into its weights (``merge_and_unload``); the
    merged values equal :func:`merged_state_dict`'s bit for bit (same sum, same order)."""
    return model.merge_and_unload() if is_peft(model) else model


def _dequantized(module) -> torch.Tensor | None:
    """The dense weight of a bitsandbytes 4-/8-bit linear layer, or None for any other."""
    weight = getattr(module, "weight", None)
    if weight is None or type(weight).__module__.split(".")[0] != "bitsandbytes":
        return None
    from peft.utils.integrations import dequantize_module_weight

    return dequantize_module_weight(module)


def merged_state_dict(model, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The state dict of the base model with every LoRA delta added, under the base model's
    own names (peft's ``base_model.model.`` prefix and ``.base_layer`` stripped, adapter
    tensors left out): what ``save_pretrained`` of the merged model writes and what a vLLM
    engine loads. Quantized (QLoRA) weights are dequantized. The model is not modified."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    lora_layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    skip = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_dropout")
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) or any(s in name.split(".") for s in skip):
            continue
        if any(name.startswith(f"{n}.") for n in lora_layers):  # base_layer of a LoRA layer
            continue
        dense = _dequantized(module)
        for pname, tensor in module.named_parameters(recurse=False):
            out[f"{name}.{pname}" if name else pname] = (
                dense if (dense is not None and pname == "weight") else tensor.detach()
            )
        for bname, tensor in module.named_buffers(recurse=False):
            if bname not in module._non_persistent_buffers_set:
                out[f"{name}.{bname}" if name else bname] = tensor.detach()
    for name, layer in lora_layers.items():
        base_layer = layer.get_base_layer()
        dense = _dequantized(base_layer)
        weight = dense if dense is not None else base_layer.weight.detach()
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
        out[f"{name}.weight"] = weight.detach()
        if getattr(base_layer, "bias", None) is not None:
            out[f"{name}.bias"] = base_layer.bias.detach()
    if dtype is not None:
        out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
    return out


def save_merged(
    model, out_dir: str | Path, *, dtype: torch.dtype | None = None, state: dict | None = None
) -> None:
    """``save_pretrained`` of the merged model into ``out_dir`` (config, generation config,
    safetensors), without modifying the adapter model. ``state``: the merged weights, when
    the caller has them already."""
    base = model.get_base_model()
    state = dict(merged_state_dict(model, dtype=dtype) if state is None else state)
    quant = getattr(base.config, "quantization_config", None)
    if quant is not None:  # QLoRA: the merged copy is dense
        del base.config.quantization_config
    try:
        hf_quantizer, base.hf_quantizer = getattr(base, "hf_quantizer", None), None
        base.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    finally:
        base.hf_quantizer = hf_quantizer
        if quant is not None:
            base.config.quantization_config = quant


def base_checkpoint(model) -> str:
    """The checkpoint folder the adapter of ``model`` sits on (the pipeline records
    it in the adapter's config when it attaches or loads one)."""
    path = model.peft_config["default"].base_model_name_or_path
    if not path or not Path(path).is_dir():
        raise ValueError(f"LoRA policy: its adapter's base {path!r} is not a checkpoint folder")
    return str(path)


def saved_base(checkpoint: str | Path) -> tuple[str, str] | None:
    """The base a LoRA checkpoint's adapter sits on, as its ``checkpoint_info.json`` records
    it: ``(lora_base, lora_base_policy_id)``; None for a checkpoint without an adapter."""
    import json

    try:
        info = json.loads((Path(checkpoint) / "checkpoint_info.json").read_text())
    except (OSError, ValueError):
        return None
    if "lora_base" not in info or not (Path(checkpoint) / ADAPTER_DIR).is_dir():
        return None
    from grpo_core.contracts.run_folder import info_path

    return info_path(checkpoint, str(info["lora_base"])), str(info["lora_base_policy_id"])


def rank(model) -> int:
    """The adapter's rank ``r``."""
    return int(model.peft_config["default"].r)


def save_adapter(model, out_dir: str | Path) -> None:
    """The adapter alone: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    model.save_pretrained(str(out_dir), safe_serialization=True)


class AdapterDisabled:
    """The reference model of a LoRA policy: the same modules, called inside peft's
    ``disable_adapter()``, so the base model's outputs come without a second copy in memory.

    Attribute access is forwarded. Methods, and sub-modules that hold LoRA layers (also when
    a method returns one, e.g. ``get_decoder()``), come wrapped the same way, so a caller
    that runs the decoder and the LM head separately still gets the base model's hidden
    states; a sub-module without LoRA layers (the LM head under ``all-linear``) is returned
    as it is. ``train()``/``eval()`` do nothing: the modules are the policy's and keep its
    mode.
    """

    def __init__(self, peft_model, target=None) -> None:
        object.__setattr__(self, "_peft_model", peft_model)
        object.__setattr__(self, "_target", peft_model if target is None else target)

    def __call__(self, *args, **kwargs):
        with self._peft_model.disable_adapter():
            out = self._target(*args, **kwargs)
        return self._wrap(out)

    def _wrap(self, value):
        import torch

        if isinstance(value, torch.nn.Module) and _has_lora(value):
            return AdapterDisabled(self._peft_model, value)
        return value

    def train(self, mode: bool = True):
        return self

    def eval(self):
        return self

    def __getattr__(self, name: str):
        import torch

        if name == "__signature__":
            import inspect

            return inspect.signature(self._target)
        value = getattr(self._target, name)
        if isinstance(value, torch.nn.Module):
            return self._wrap(value)
        if callable(value) and not isinstance(value, type):
            return AdapterDisabled(self._peft_model, value)
        return value


def _has_lora(module) -> bool:
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in module.modules())


@contextmanager
def adapter_disabled(model):
    """``disable_adapter()`` of a ``PeftModel``; nothing for any other model."""
    if is_peft(model):
        with model.disable_adapter():
            yield
    else:
        yield


def reference_of(model):
    """The reference model to pass where a separate model is expected: the base of a
    ``PeftModel`` with its adapter disabled."""
    return AdapterDisabled(model)
