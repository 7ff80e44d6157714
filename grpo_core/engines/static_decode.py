"""The hf engine's decode loop on a static KV cache, for GPUs (``decode: static|cuda_graphs``).

The dynamic loop (``grpo_core.engines.generation``) suits a CPU: it drops finished rows from the
batch and its KV cache, so the work follows the live rows. On a GPU each decode step of a
small model is a few milliseconds of kernels behind tens of milliseconds of Python and host
synchronisation, so this loop keeps every shape fixed instead (HF's static-cache generation
is the reference):

- one ``StaticCache`` of ``prompt + max_new_tokens`` positions, written at ``cache_position``;
- the attention mask built here, 4-D, from a ``[B, L + T]`` buffer of the positions each row
  may attend to (HF returns a 4-D mask as it is: no mask logic, no host read per step);
- finished rows stay in the batch (their tokens are recorded as padding), EOS is checked on
  the device, and the host reads ``done.all()`` only every ``CHECK_EVERY`` steps; stop strings
  are matched on the host every ``CHECK_EVERY`` steps over the new tokens, a hit at step s
  ends the row at s exactly as the per-step check would;
- ``cuda_graphs``: the decode step's forward is captured once per micro-batch in a CUDA graph
  and replayed (static input buffers, the cache and parameters at fixed addresses); if the
  capture fails the loop goes on without the graph and says so once.

Sampling is the same as the dynamic loop's (:func:`grpo_core.engines.decode_step.next_tokens`: same
logit adjustments), and so is what is recorded (grpo_core/engines/token_logprobs.py: logprob
of the sampled token under the adjusted distribution, and under the policy's own softmax
when that was processed).
"""

from __future__ import annotations

import logging

import torch
from transformers import StaticCache

from grpo_core.engines.decode_step import (
    DecodeBatch,
    count_prefill,
    forward_takes,
    keeps_last_logits,
    left_pad,
    next_tokens,
    repetition_penalty,
    seen_tokens,
)
from grpo_core.engines.token_logprobs import Completions, processes_distribution
from grpo_core.engines.turn_cache import static_shape

log = logging.getLogger(__name__)

CHECK_EVERY = 16  # decode steps between host reads (all rows done? stop strings?)
_GRAPH_FAILED: set[str] = set()  # one warning per reason and process


def static_unsupported(model) -> str | None:
    """Why ``model`` cannot decode on the static path (``None``: it can)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} (static decoding builds sdpa/eager masks)"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    return None


def _mask(allowed: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` ``[B, 1, q, K]`` bool as the attention implementation takes a 4-D mask:
    sdpa a bool mask (True: attend), eager an additive float mask."""
    if impl == "sdpa":
        return allowed
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)


class _Step:
    """The decode step's forward on static buffers, replayed from a CUDA graph when
    ``graphs`` (captured at the first call)."""

    def __init__(self, model, cache, keys: torch.Tensor, graphs: bool, extra: dict) -> None:
        B, _ = keys.shape
        dev = keys.device
        self.model, self.cache, self.keys, self.extra = model, cache, keys, extra
        self.impl = model.config._attn_implementation
        self.dtype = next(model.parameters()).dtype
        self.ids = torch.zeros((B, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((B, 1), dtype=torch.long, device=dev)
        self.cpos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs = graphs and dev.type == "cuda"
        self.graph = None
        self.out = None
        self.mode = "cuda_graphs" if self.graphs else "static"

    def _forward(self) -> torch.Tensor:
        dev = self.keys.device.type
        if torch.is_autocast_enabled(dev):  # a graph must not keep autocast's cached casts
            with torch.autocast(dev, torch.get_autocast_dtype(dev), cache_enabled=False):
                return self._model_forward()
        return self._model_forward()

    def _model_forward(self) -> torch.Tensor:
        mask = _mask(self.keys[:, None, None, :], self.impl, self.dtype)  # [B, 1, 1, K]
        extra = {"cache_position": self.cpos} if self.extra.get("cache_position") else {}
        return self.model(
            input_ids=self.ids,
            attention_mask=mask,
            position_ids=self.pos,
            past_key_values=self.cache,
            use_cache=True,
            **extra,
        ).logits[:, -1, :]

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor, cache_position: int) -> torch.Tensor:
        self.ids.copy_(tok[:, None])
        self.pos.copy_(pos)
        self.cpos.fill_(cache_position)
        if not self.graphs:
            return self._forward()
        if self.graph is None:
            self._capture()
            if self.graph is None:
                return self._forward()
        self.graph.replay()
        return self.out

    def _capture(self) -> None:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward()  # warm-up: writes this step's cache slot, as the replay will
            torch.cuda.current_stream().wait_stream(side)
            _rewind(self.cache, 1)  # caches that count their own length: back one step
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.out = self._forward()
            self.graph = graph
        except Exception as e:  # the eager step is the same computation
            self.graphs, self.graph, self.mode = False, None, "static"
            reason = f"{type(e).__name__}: {e}"[:300]
            if reason not in _GRAPH_FAILED:
                _GRAPH_FAILED.add(reason)
                log.warning("hf engine: CUDA graph capture failed, decoding without: %s", reason)


@torch.no_grad()
def generate_batch_static(model, batch: DecodeBatch, *, graphs: bool = False):
    """``grpo_core.engines.generation._generate_batch`` with fixed shapes (module docstring).
    ``batch.stats``: gets ``decode`` (the mode that ran), ``steps`` and the prefill's tokens.
    ``batch.turn``: the episodes' KV kept from their earlier turns, and the pool of caches
    and captured steps kept across turns (grpo_core/engines/turn_cache.py)."""
    prompts, params, pad_id, generator = batch.prompts, batch.params, batch.pad_id, batch.generator
    stop_hits, stats, turn, budgets = batch.stop_hits, batch.stats, batch.turn, batch.budgets
    eos_ids = batch.eos_ids
    device = model.device
    B, T = len(prompts), params.max_new_tokens
    prompt_ids, prompt_attn = left_pad(prompts, pad_id, device)  # [B, L]
    s = _Slots(model, prompt_ids, prompt_attn, pad_id, turn, graphs, T)
    logits, pos = _prefill(model, s.ids, s.attn, s.keys, s.cache, s.P, s.with_position)
    count_prefill(stats, s.attn[:B, s.P :])
    out = Completions(B, T, pad_id, device, policy=processes_distribution(params))
    eos = torch.tensor(sorted(eos_ids), device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    seen = None  # [B, V] the contexts' tokens, prompt without padding (repetition penalty)
    if params.repetition_penalty != 1.0:
        seen = seen_tokens(logits.shape[-1], prompt_ids, prompt_attn)
    budget = None if budgets is None else torch.tensor(budgets, device=device)  # [B]
    host = _StopStrings(stop_hits, B) if stop_hits is not None else None
    padding = s.ids.new_full((s.R - B,), pad_id)  # the padding rows' tokens (rows rounded up)
    last, W = pos[:, -1:], s.W  # [B, 1]
    steps = 0
    for t in range(T):
        logits = raw = logits[:B].float()  # padding rows are never sampled
        if seen is not None:
            logits = repetition_penalty(logits, seen, params.repetition_penalty)
        logprobs, tok = next_tokens(logits, params, generator)  # [B, V], [B]
        tok = torch.where(done, pad_id, tok)
        out.record_all(t, done, tok, logprobs, raw, params.temperature)
        hit = torch.isin(tok, eos) & ~done
        out.lengths = torch.where(hit, t + 1, out.lengths)
        out.stopped |= hit
        done |= hit
        if seen is not None:
            seen.scatter_(1, tok[:, None], (~done | hit)[:, None])
        if budget is not None:  # rows at their own budget: finished (length)
            spent = (budget <= t + 1) & ~done
            out.lengths = torch.where(spent, t + 1, out.lengths)
            done |= spent
        steps = t + 1
        last_step = t + 1 == T
        if host is not None and (last_step or steps % CHECK_EVERY == 0):
            host.check(out, done, steps)
        if last_step or (steps % CHECK_EVERY == 0 and bool(done.all())):
            break
        s.keys[:, W + t] = True
        last = last + 1
        logits = s.step(torch.cat([tok, padding]) if s.R > B else tok, last, W + t)
    if stats is not None:
        stats["decode"] = s.step.mode
        stats["steps"] = steps
    if turn is not None:
        turn.keep_static(s.cache, s.attn, out.lengths.tolist(), out.stopped.tolist(), B)
    return out.lists()


class _Slots:
    """A micro-batch's fixed shapes before its prefill: ``R`` rows (``B`` rounded up by a
    turn cache's pool; the extra ones padding, finished from the start) by ``K`` positions,
    the ``StaticCache``, the positions each row sees (``keys``), and the decode step (kept
    across turns by a turn cache); ``ids``/``attn`` what the prefill feeds and attends to,
    after ``P`` positions of KV kept from earlier turns (written into the cache here), ``W``
    positions in all before decoding."""

    def __init__(self, model, ids, attn, pad_id: int, turn, graphs: bool, T: int) -> None:
        B, device = ids.shape[0], ids.device
        laid = None if turn is None else turn.layout(pad_id, device)
        self.P = 0  # positions of kept KV before the fed tokens
        if laid is not None:
            kv, ids, attn, self.P = laid  # ids [B, N] new tokens, attn [B, P + N]
        self.W = W = attn.shape[1]  # the positions before decoding
        R, K = static_shape(None if turn is None else turn.owner, B, W + T)
        self.R = R
        if R > B:
            ids = torch.cat([ids, ids.new_full((R - B, ids.shape[1]), pad_id)])
            attn = torch.cat([attn, attn.new_zeros((R - B, W))])
        self.ids, self.attn = ids, attn
        self.with_position = forward_takes(model, "cache_position")

        def make():
            keys = torch.zeros((R, K), dtype=torch.bool, device=device)  # positions a row sees
            cache = StaticCache(config=model.config, max_cache_len=K)
            extra = {"cache_position": self.with_position}
            return cache, keys, _Step(model, cache, keys, graphs, extra)

        slots = make() if turn is None else turn.owner.static_slots(R, K, make)
        self.cache, self.keys, self.step = slots
        self.keys[:, :W] = attn.bool()
        if laid is not None:  # the kept KV in the first P positions
            for layer, (k, v) in enumerate(kv):
                self.cache.update(torch.cat([k, k.new_zeros((R - B, *k.shape[1:]))]),
                                  torch.cat([v, v.new_zeros((R - B, *v.shape[1:]))]), layer)  # fmt: skip


def _prefill(model, ids, attn, keys, cache, offset: int = 0, with_position: bool = False):
    """The prompts' forward into ``cache`` after ``offset`` positions already there (a turn's
    kept KV): causal over each row's real tokens (a padding query sees itself, so no row is
    empty). ``attn`` [B, offset + L]: the positions each row attends to. Returns the last
    position's logits [B, V] and the fed tokens' positions [B, L]."""
    device, L, K = ids.device, ids.shape[1], keys.shape[1]
    causal = torch.ones((L, K), dtype=torch.bool, device=device).tril(offset)  # [L, K]
    eye = torch.eye(L, K - offset, dtype=torch.bool, device=device)  # [L, K - offset]
    eye = torch.cat([eye.new_zeros((L, offset)), eye], dim=1)  # [L, K]: each query itself
    allowed = (causal[None] & keys[:, None, :]) | eye[None]  # [B, L, K]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, offset:]  # [B, L]
    extra = {"logits_to_keep": 1} if keeps_last_logits(model) else {}
    if with_position:
        extra["cache_position"] = torch.arange(offset, offset + L, device=device)
    impl, dtype = model.config._attn_implementation, next(model.parameters()).dtype
    logits = model(
        input_ids=ids,
        attention_mask=_mask(allowed[:, None], impl, dtype),
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        **extra,
    ).logits[:, -1, :]
    return logits, pos


class _StopStrings:
    """Stop strings matched on the host, every ``CHECK_EVERY`` steps, token by token as the
    dynamic loop does; a hit at step s ends the row there (length s + 1, finish 'stop')."""

    def __init__(self, stop_hits, B: int) -> None:
        self.stop_hits = stop_hits
        self.gen: list[list[int]] = [[] for _ in range(B)]
        self.checked = 0  # steps already matched
        self.ended = [False] * B

    def check(self, out, done: torch.Tensor, steps: int) -> None:
        new = out.tokens[:, self.checked : steps].tolist()  # [B, k]
        lengths = out.lengths.tolist()
        hits_at: dict[int, int] = {}
        for j in range(steps - self.checked):
            s = self.checked + j
            rows = [
                r
                for r in range(len(new))
                if not self.ended[r] and s < lengths[r]  # (a row cut at its budget: too)
            ]
            for r in rows:
                self.gen[r].append(new[r][j])
            if not rows:
                continue
            for r, hit in zip(rows, self.stop_hits([self.gen[r] for r in rows]), strict=True):
                if hit:
                    self.ended[r] = True
                    hits_at[r] = s
        self.checked = steps
        if hits_at:
            idx = torch.tensor(list(hits_at), dtype=torch.long, device=done.device)
            at = torch.tensor(list(hits_at.values()), dtype=torch.long, device=done.device)
            out.lengths[idx] = at + 1
            out.stopped[idx] = True
            done[idx] = True


def _rewind(cache, n: int) -> None:
    """Undo ``n`` steps of the length counter of caches that keep one (transformers 5's
    static layers write at their ``cumulative_length`` rather than a ``cache_position``)."""
    for layer in getattr(cache, "layers", []):
        c = getattr(layer, "cumulative_length", None)
        if isinstance(c, torch.Tensor):
            c.sub_(n)
        elif isinstance(c, int):
            layer.cumulative_length = c - n
