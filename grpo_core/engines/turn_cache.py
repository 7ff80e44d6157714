"""The hf engine's KV cache kept across the turns of a multi-turn episode.

Without it each turn of a tool episode is a fresh ``generate`` over the episode's whole
context (prompt, earlier turns, observations), so the prefill grows with the turns and an
episode's cost with their square. A :class:`TurnCache` lives for one turn loop
(grpo_core/engines/turns.py): when a sample stops, the KV of the tokens the model was fed
(its context and its completion but the last token) is copied out of the micro-batch's cache
and kept under its episode's key; at the episode's next turn, whose context starts with
those tokens, only the tokens after them (the last sampled token, the observation) are fed.

A micro-batch of episodes with different kept lengths is laid out with holes: each row's
kept KV right-aligned in the first ``P`` positions (the longest kept), then its new tokens
right-aligned in the next ``N`` (the most new), an attention mask over both and position
ids from the mask, so each row continues at its own position. Decoding then goes on as for
a prompt. The static loop (grpo_core/engines/static_decode.py) writes the same layout into a
``StaticCache`` and, with a turn cache, takes its cache, mask buffer and decode step (with its
CUDA graph) from a pool kept across the turns, rows rounded up to a power of two (padding
rows finished from the start) and positions to a multiple of ``STATIC_ROUND``: a later turn
whose shape rounds to one already seen replays that graph instead of capturing another.

The kept KV is the prefix's as the earlier turn computed it, not a recomputation over the
whole context: the same values up to float rounding (sums in another order and shape), so
a sample can differ from the one a full recompute would draw where two tokens nearly tie.
Each episode's KV is dropped when it ends, and all of it when the turn loop returns. Nothing
here imports prefect, mlflow or ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STATIC_ROUND = 64  # the static pool's positions are rounded up to a multiple of this


@dataclass
class _Kept:
    ids: list[int]  # the tokens whose KV this is: the first len(ids) of the next context
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, keys and values [heads, len, dim]


class TurnCache:
    """The kept KV of one turn loop's episodes (module docstring), and the static loop's
    pool (at most ``POOL`` shapes, the oldest dropped first)."""

    POOL = 4

    def __init__(self) -> None:
        self.kept: dict = {}
        self.pool: dict = {}  # (rows, positions) -> the static loop's cache, mask, step
        self.off = False  # a cache this module cannot read: every turn fed whole

    def batch(self, episodes: list, contexts: list[list[int]]) -> _Turn:
        """The micro-batch of ``episodes`` (their keys) with these contexts."""
        return _Turn(self, list(episodes), contexts)

    def drop(self, episode) -> None:
        """The episode ended: its KV is not needed again."""
        self.kept.pop(episode, None)

    def close(self) -> None:
        self.kept.clear()
        self.pool.clear()

    def static_slots(self, rows: int, positions: int, make):
        """The pooled ``(cache, keys, step)`` for this shape, reset; ``make()`` builds one
        the first time (its step captures its graph at its first call)."""
        shape = (rows, positions)
        if shape not in self.pool:
            if len(self.pool) >= self.POOL:
                del self.pool[next(iter(self.pool))]
            self.pool[shape] = make()
            return self.pool[shape]
        cache, keys, step = self.pool[shape]
        cache.reset()
        keys.zero_()
        return cache, keys, step


def static_shape(turns: TurnCache | None, rows: int, positions: int) -> tuple[int, int]:
    """The static loop's rows and positions: as they are without a turn cache, else
    rounded up so that later turns find a shape already captured."""
    if turns is None:
        return rows, positions
    return 1 << (rows - 1).bit_length(), -(-positions // STATIC_ROUND) * STATIC_ROUND


class _Turn:
    """One micro-batch's use of the turn cache: its rows' kept KV going in, and the KV of
    the rows that stop coming out (:meth:`keep`, then :meth:`done` with the completions)."""

    def __init__(self, owner: TurnCache, episodes: list, contexts: list[list[int]]) -> None:
        self.owner, self.episodes, self.contexts = owner, episodes, contexts
        self.prior = [self._prefix(e, c) for e, c in zip(episodes, contexts, strict=True)]
        self.fresh: dict[int, list] = {}  # row -> its KV, per layer

    def _prefix(self, episode, context: list[int]) -> _Kept | None:
        kept = None if self.owner.off else self.owner.kept.get(episode)
        if kept is None or len(kept.ids) >= len(context):
            return None
        return kept if context[: len(kept.ids)] == kept.ids else None

    def layout(self, pad_id: int, device):
        """The rows' kept KV and new tokens laid out (module docstring), or None when no
        row has KV kept: ``(kv, new_ids [B, N], attn [B, P + N], P)``, kv per layer
        ``[B, heads, P, dim]`` keys and values."""
        lengths = [0 if k is None else len(k.ids) for k in self.prior]
        if not any(lengths):
            return None
        B, P = len(self.contexts), max(lengths)
        new = [c[n:] for c, n in zip(self.contexts, lengths, strict=True)]
        N = max(map(len, new))
        ids = [[pad_id] * (N - len(x)) + x for x in new]
        attn = [[0] * (P - n) + [1] * n + [0] * (N - len(x)) + [1] * len(x)
                for n, x in zip(lengths, new, strict=True)]  # fmt: skip
        some = next(k for k in self.prior if k is not None).kv
        kv = []
        for layer, (k0, v0) in enumerate(some):
            keys = k0.new_zeros((B, k0.shape[0], P, k0.shape[2]))
            values = v0.new_zeros((B, v0.shape[0], P, v0.shape[2]))
            for r, kept in enumerate(self.prior):
                if kept is not None:
                    n = len(kept.ids)
                    keys[r, :, P - n :] = kept.kv[layer][0]
                    values[r, :, P - n :] = kept.kv[layer][1]
            kv.append((keys, values))
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return kv, as_tensor(ids), as_tensor(attn), P

    def start(self, ids: torch.Tensor, attn: torch.Tensor, pad_id: int):
        """The dynamic loop's start: ``(cache, step_ids, attn, step_pos)`` with the kept KV
        in a ``DynamicCache`` and only the new tokens to feed; None: feed the contexts."""
        from transformers import DynamicCache

        laid = self.layout(pad_id, ids.device)
        if laid is None:
            return None
        kv, new_ids, attn, P = laid
        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k, v, layer)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, P:]  # [B, N]: each row's own positions
        return cache, new_ids, attn, pos

    def keep(self, cache, which: torch.Tensor, rows: torch.Tensor, attn: torch.Tensor) -> None:
        """Copy out the KV of batch rows ``which`` (micro-batch rows ``rows[which]``), the
        positions their mask ``attn`` attends to (dynamic loop)."""
        from transformers.cache_utils import DynamicLayer

        if self.owner.off or not len(which):
            return
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            self.owner.off = True  # sliding windows, linear attention: not this layout
            return
        S = cache.get_seq_length()
        for i in which.tolist():
            m = attn[i, :S].bool()
            self.fresh[int(rows[i])] = [(x.keys[i][:, m], x.values[i][:, m]) for x in cache.layers]

    def keep_static(self, cache, attn: torch.Tensor, lengths, stopped, B: int) -> None:
        """Copy out the KV of the static loop's rows that stopped: the layout's positions
        ``attn`` [rows, W] attends to and the decoded ones before each row's last token."""
        if self.owner.off:
            return
        W, K = attn.shape[1], cache.layers[0].keys.shape[2]
        decoded = torch.arange(K - W, device=attn.device)
        for r in range(B):
            if bool(stopped[r]):
                m = torch.cat([attn[r].bool(), decoded < int(lengths[r]) - 1])
                self.fresh[r] = [(x.keys[r][:, m], x.values[r][:, m]) for x in cache.layers]

    def done(self, completions: list[list[int]]) -> None:
        """The micro-batch's completions: the kept KV of each row that stopped, under its
        episode (its tokens: the context and the completion but its last token)."""
        for r, episode in enumerate(self.episodes):
            self.owner.kept.pop(episode, None)  # an earlier turn's: superseded
            kv = self.fresh.get(r)
            if kv is None or self.owner.off:
                continue
            ids = self.contexts[r] + completions[r][:-1]
            if kv[0][0].shape[1] == len(ids):  # else not what this module laid out: feed it
                self.owner.kept[episode] = _Kept(ids, kv)
        self.fresh.clear()
