"""Per-token log-probs of a causal LM's labels, from the decoder's hidden states through the LM
head in chunks (``grpo_core.logprobs.lm_head``), or from the model's logits when the model computes
its logits some other way.

``labels[:, t]`` is the token that position ``t`` predicts (already shifted); positions with a
label < 0 give log-prob (and entropy) 0 and are never sent through the head: the GRPO update
labels only completion tokens, so prompt positions cost nothing past the decoder.

The chunked path needs ``logits == lm_head(decoder(...).last_hidden_state)``. It is refused,
with a one-line reason, for a head that is not a plain ``torch.nn.Linear`` (quantised, or a
LoRA-wrapped head), for configs that post-process logits (Gemma's
``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``), for
peft prompt-learning adapters, and when a probe (one forward of a few tokens, once per model)
finds the model's logits differ from the head applied to the decoder's output.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref

import torch
from torch import Tensor

from grpo_core.logprobs.lm_head import linear_token_logprobs
from grpo_core.logprobs.tokens import token_logprobs

log = logging.getLogger(__name__)
LM_HEAD_MODES = ("chunked", "logits")
LOGIT_POSTPROCESSING = {  # config attribute -> values that leave the logits as they are
    "final_logit_softcapping": (None, 0, 0.0),
    "logit_scale": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
}
_REASONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> reason or ""


def _static_reason(model) -> str | None:
    config = getattr(model, "config", None)
    for name, neutral in LOGIT_POSTPROCESSING.items():
        value = getattr(config, name, None)
        if value not in neutral:
            return f"config.{name}={value} post-processes the logits"
    if getattr(getattr(model, "peft_config", {}).get("default"), "is_prompt_learning", False):
        return "a peft prompt-learning adapter changes the decoder's inputs"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return f"the LM head is {type(head).__name__}, not torch.nn.Linear"
    if not hasattr(model, "get_decoder"):
        return "the model has no get_decoder()"
    return None


@torch.no_grad()
def _probe(model) -> str | None:
    """Compare the model's logits with the head over the decoder's output on a few tokens."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        vocab = model.get_output_embeddings().weight.shape[0]
        device = model.get_output_embeddings().weight.device
        ids = torch.arange(1, 6, device=device).remainder(vocab).unsqueeze(0)  # [1, 5]
        attn = torch.ones_like(ids)
        want = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attn, use_cache=False)
        got = model.get_output_embeddings()(hidden.last_hidden_state).float()
    except Exception as e:  # noqa: BLE001 - any failure means "use the model's own forward"
        return f"the decoder/head probe failed ({type(e).__name__}: {e})"
    finally:
        for m, training in modes:
            m.training = training
    diff = float((want - got).abs().max())
    low = model.get_output_embeddings().weight.dtype in (torch.bfloat16, torch.float16)
    tol = (1e-2 if low else 1e-4) * (1.0 + float(want.abs().max()))  # same ops: ~0 expected
    if got.shape != want.shape or diff > tol:
        return f"the model's logits differ from lm_head(decoder output) by {diff:.3g}"
    return None


def chunked_head_reason(model) -> str | None:
    """Why the chunked LM-head path cannot reproduce ``model``'s logits; ``None`` when it can."""
    cached = _REASONS.get(model)
    if cached is not None:
        return cached or None
    reason = _static_reason(model) or _probe(model)
    _REASONS[model] = reason or ""
    if reason:
        log.warning("LM head: full logits instead of the chunked head: %s", reason)
    return reason


HEAD_METHOD = "grpo_head_logprobs"  # the name :func:`head_logprobs` is bound under by FSDP


def head_logprobs(
    model, kw: dict, labels: Tensor, *, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """The chunked path of :func:`model_logprobs`: the decoder's hidden states of the
    labelled positions through the LM head in chunks (``kw``: the decoder's inputs)."""
    n, L = labels.shape
    valid = labels >= 0
    head = model.get_output_embeddings()
    hidden = model.get_decoder()(**kw).last_hidden_state  # [n, L, H]
    flat = valid.reshape(-1).nonzero().squeeze(-1)  # [M] labelled positions
    lp, ent = linear_token_logprobs(
        hidden.reshape(n * L, -1)[flat],
        head.weight,
        labels.reshape(-1)[flat],
        bias=head.bias,
        temperature=temperature,
        with_entropy=with_entropy,
    )  # [M] each
    zeros = torch.zeros(n * L, dtype=lp.dtype, device=lp.device)
    logp = zeros.index_put((flat,), lp).view(n, L)
    entropy = None if ent is None else zeros.index_put((flat,), ent).view(n, L)
    return logp, entropy


def _accepts_logits_to_keep(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def model_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    labels: Tensor,
    *,
    position_ids: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    lm_head: str = "chunked",
) -> tuple[Tensor, Tensor | None]:
    """Log-prob ``[n, L]`` of ``labels[:, t]`` at position ``t`` (0 where ``labels < 0``), and
    the entropy of those positions (0 elsewhere) when ``with_entropy``.

    ``lm_head``: ``"chunked"`` (the hidden states through the head in chunks, falling back to
    ``"logits"`` with a logged reason when the model needs it) or ``"logits"`` (the model's
    logits of the positions from the first labelled one on, then ``token_logprobs``).
    """
    if lm_head not in LM_HEAD_MODES:
        raise ValueError(f"lm_head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
    n, L = labels.shape
    valid = labels >= 0  # [n, L]
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    if position_ids is not None:
        kw["position_ids"] = position_ids
    if lm_head == "chunked" and chunked_head_reason(model) is None:
        # a model sharded whole by FSDP2 runs it as one of its forwards (grpo_core/training/fsdp.py)
        run = getattr(model, HEAD_METHOD, None) or functools.partial(head_logprobs, model)
        return run(kw, labels, temperature=temperature, with_entropy=with_entropy)
    cols = valid.any(0).nonzero()
    first = int(cols[0]) if len(cols) else L - 1
    keep = L - first  # the logits of positions first..L-1
    if _accepts_logits_to_keep(model):
        kw["logits_to_keep"] = keep
    logits = model(**kw).logits[:, -keep:]  # [n, keep, V]
    lp, ent = token_logprobs(
        logits, labels[:, first:], temperature=temperature, with_entropy=with_entropy
    )  # [n, keep] each
    pad = (first, 0)
    logp = torch.nn.functional.pad(lp, pad)
    entropy = None if ent is None else torch.nn.functional.pad(ent * valid[:, first:], pad)
    return logp, entropy
