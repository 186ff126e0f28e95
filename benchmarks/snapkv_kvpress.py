"""kvpress's decoding-time SnapKV rule as a kvcompose pipeline, and the steps between it and kvcompose's `snapkv`.

kvpress 0.5.5's `DecodingPress(SnapKVPress(window_size=16), compression_interval=64, target_size=B)` does, at
every 64th decoded token of every layer whose cache holds more than B slots (kvpress/presses/snapkv_press.py,
decoding_press.py):

1. queries: the pre-RoPE queries of the last 16 buffered hidden states, **all rotated with the RoPE of the
   newest token** (`position_embeddings` of the forward call that decodes one token; `cos[:, -16:]` of a
   one-position tensor is that one position), so the 15 older window queries sit at the wrong position;
2. attention: their softmax over every held key (causal inside the window), in float32; the window's own 16
   keys are then sliced off *after* the softmax (no renormalisation);
3. mean over the 16 queries, `avg_pool1d(kernel 5, padding 2, count_include_pad=True)` over the remaining
   keys **in cache-slot order**, mean over the GQA group;
4. the 16 window tokens are kept (score max + 1) and `topk(B)` keeps the rest; the kept slots stay in `topk`
   order (descending score), so after the first event "neighbours" in step 3 are tokens of similar past
   score, not of neighbouring positions; tokens decoded since the last event follow in time order.

kvcompose's `snapkv` preset instead uses 32 queries at their own positions, keeps 32 recent tokens, pools in
time order over every held key (the window's scores included at the window's edge) and keeps time order.

`KvpressSnapKV` below is step 1-3 as a kvcompose scorer, each difference switchable. Step 4's slot order is
state kvpress keeps implicitly in its cache layout; kvcompose keeps tokens in time order, so the scorer can
only reproduce it by recording, per layer and row, the order `topk` will leave (`slot_order={}`): that makes
the scorer stateful outside the pipeline's state (one instance per cache), which is why it lives here, as an
emulation for tests/test_snapkv_kvpress.py and the bench (`--pipelines benchmarks/snapkv_kvpress.py`), and
not among kvcompose's blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompose import Pipeline, ProtectRecent, TopK, methods
from kvcompose.scorers import Scorer
from kvcompose.view import LayerView

SMOLLM2_ROPE_THETA = 100000.0  # SmolLM2-135M-Instruct's rope_theta (its config; checked by the bench script)


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rerotate(queries: Tensor, positions: Tensor, target: int, theta: float) -> Tensor:
    """Post-RoPE queries `[B, Hq, W, D]` at `positions` `[W]` moved to position `target` (default Llama RoPE,
    half-split: RoPE(q, p) = R(p) q and R(a) R(b) = R(a + b), so R(target - p) RoPE(q, p) = RoPE(q, target))."""
    d = queries.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=queries.device) / d))
    delta = (target - positions).to(torch.float32)  # [W]
    ang = delta[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)  # [W, D]
    cos, sin = emb.cos(), emb.sin()
    q = queries.float()
    return q * cos + _rotate_half(q) * sin


class KvpressSnapKV(Scorer):
    """kvpress's decoding-time SnapKV score (see the module docstring), `LayerView -> Float[B, H, T]`.

    Args:
        window: observation window (kvpress: 16 in DecodingPress at interval 64).
        kernel: average-pooling width (5).
        rope_theta: with a value, the window queries are re-rotated to the newest token's position, as kvpress
            does; None keeps each query at its own position (kvcompose).
        drop_window: kvpress's handling of the window's keys: in the softmax, out of the pooling (their slots
            are edge padding); False pools over them too (kvcompose's `WindowedAttention`).
        slot_order: a dict (one per cache) in which the scorer records the order kvpress's `topk` leaves the
            kept tokens in, per (layer, row, KV head), and pools in that order at the next event; None pools in
            time order (what kvpress does once its kept indices are sorted).
    """

    def __init__(self, window: int = 16, kernel: int = 5, rope_theta: float | None = SMOLLM2_ROPE_THETA,
                 drop_window: bool = True, slot_order: dict | None = None):
        self.window, self.kernel, self.rope_theta, self.drop_window = window, kernel, rope_theta, drop_window
        self._slot_order = slot_order

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def __repr__(self) -> str:
        return (f"KvpressSnapKV(window={self.window}, kernel={self.kernel}, rope_theta={self.rope_theta}, "
                f"drop_window={self.drop_window}, slot_order={self._slot_order is not None})")

    def score(self, view: LayerView) -> Tensor:
        b, h, t, d = view.keys.shape
        w = self.window
        q = view.queries[:, :, -w:]
        qpos = view.query_positions[-w:]
        if self.rope_theta is not None:
            q = rerotate(q, qpos, view.seen - 1, self.rope_theta)
        g = q.shape[1] // h
        logits = torch.einsum("bhgwd,bhtd->bhgwt", q.float().reshape(b, h, g, w, d), view.keys.float()) * view.scale
        allowed = view.valid[:, :, None, None, :] & (view.positions[:, :, None, None, :] <= qpos[None, None, None, :, None])
        p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)  # over every held key, window too
        p = torch.where(allowed, p, torch.zeros_like(p)).mean(3)  # mean over the window queries: [B, H, G, T]
        window = view.positions >= view.seen - w  # [B, H, T]
        cand = view.valid & ~window if self.drop_window else view.valid
        p = p.masked_fill(~cand[:, :, None], 0.0)
        order = self._order(view, cand)  # [B, H, T]: the slots in pooling order, candidates first
        # the candidates in pooling order, then zeros: the pooled sequence ends at its last candidate, as
        # kvpress's sliced tensor does (avg_pool1d zero-pads both edges, count_include_pad=True)
        x = p.gather(-1, order[:, :, None].expand_as(p))
        y = F.avg_pool1d(x.reshape(b * h * g, 1, t), self.kernel, stride=1, padding=self.kernel // 2,
                         count_include_pad=True).reshape(b, h, g, t)
        scores = torch.zeros_like(y).scatter_(-1, order[:, :, None].expand_as(y), y).mean(2)  # back to slots, GQA mean
        scores = torch.where(cand, scores, torch.zeros_like(scores))
        if self._slot_order is not None:
            self._record(view, scores, cand, window)
        return scores

    def _order(self, view: LayerView, cand: Tensor) -> Tensor:
        """Pooling order: kvpress's slot order of the candidates (recorded at the last event, then the newer
        tokens by position), or time order; non-candidates after them."""
        b, h, t = cand.shape
        far = torch.iinfo(torch.long).max // 4
        key = torch.where(cand, view.positions, torch.full_like(view.positions, far))
        if self._slot_order is not None:
            rank = self._slot_order.get(view.layer_idx)
            if rank is not None:
                # rank[pos] = the slot kvpress put that position in at the last event; new tokens come after
                looked = torch.full_like(view.positions, -1)
                for bi in range(b):
                    for hi in range(h):
                        table = rank[bi][hi]
                        looked[bi, hi] = torch.tensor([table.get(int(p), -1) for p in view.positions[bi, hi]])
                old = looked >= 0
                key = torch.where(cand & old, looked - far // 2, key)
        return key.argsort(dim=-1, stable=True)

    def _record(self, view: LayerView, scores: Tensor, cand: Tensor, window: Tensor) -> None:
        """The slot order kvpress's `topk` leaves: window first (max + 1, in slot order), then by score."""
        b, h, t = scores.shape
        order = self._order(view, cand)
        win_order = view.positions.masked_fill(~(window & view.valid), torch.iinfo(torch.long).max).argsort(-1)
        # kvpress's score vector: the candidates in slot order, then the window in time order at max + 1
        n_c = cand.sum(-1)
        rank: list[list[dict[int, int]]] = []
        for bi in range(b):
            rows = []
            for hi in range(h):
                c = order[bi, hi, : int(n_c[bi, hi])]
                wdx = win_order[bi, hi, : int((window & view.valid)[bi, hi].sum())]
                vec = torch.cat([scores[bi, hi, c], torch.full((len(wdx),), float(scores.max()) + 1)])
                slots = torch.cat([c, wdx])
                keep = min(len(vec), int(view.cache_budget or len(vec)))
                top = vec.topk(keep).indices
                rows.append({int(view.positions[bi, hi, slots[j]]): i for i, j in enumerate(top.tolist())})
            rank.append(rows)
        self._slot_order[view.layer_idx] = rank


def kvpress_snapkv(budget: int | None = None, window: int = 16, rope_theta: float | None = SMOLLM2_ROPE_THETA,
                   drop_window: bool = True, slot_order: bool = True) -> Pipeline:
    """kvpress's `DecodingPress(SnapKVPress(window_size=16), 64, B)` rule: the window protected, the rest by
    `KvpressSnapKV`, top-k. With `slot_order=True` the pipeline is stateful (build one per cache)."""
    scorer = KvpressSnapKV(window, rope_theta=rope_theta, drop_window=drop_window,
                           slot_order={} if slot_order else None)
    return Pipeline(ProtectRecent(window), scorer, TopK(), name=repr(scorer), interval=64)


# the steps from kvcompose's snapkv to kvpress's rule (`kvcompose bench fidelity --pipelines` this file)
PIPELINES = {
    "snapkv(window=16)": lambda budget: methods.snapkv(window=16),
    "kvpress-snapkv(own rope, time order)": lambda budget: kvpress_snapkv(budget, rope_theta=None, slot_order=False),
    "kvpress-snapkv(time order)": lambda budget: kvpress_snapkv(budget, slot_order=False),
    "kvpress-snapkv": lambda budget: kvpress_snapkv(budget),
}
