"""Per-head and per-request budgets: `HeadUtility` (ReasonAlloc's online head reallocation) and `GrowPage`
(on-demand pages). Both use paged storage (`uniform = False`)."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..block import LayerSchedule, require_role
from ..hostsync import with_host
from ..kernels import window_attention_scores
from ..kernels.ref import top_last
from ..view import FAR_POSITION, KVComposeError, LayerSpec, LayerView
from .base import Allocator, _check_budget, _is_int, _share, round_to_total

__all__ = ["HeadUtility", "GrowPage"]


def _coverage_mask(p: Float[Tensor, "B H T"], coverage: float) -> Bool[Tensor, "B H T"]:
    """True for the smallest set of largest entries of each row that covers `coverage` of its mass."""
    s, idx = p.sort(dim=-1, descending=True)
    cum = s.cumsum(-1)
    inside = (cum - s) < coverage * cum[..., -1:]
    inside &= s > 0
    return torch.zeros_like(inside).scatter_(-1, idx, inside)


class HeadUtility(Allocator):
    """ReasonAlloc's online head-wise reallocation: at each compression event a layer's total
    (`H * layer_budget` per row) moves toward the KV heads of high utility, with a floor per head.

    ReasonAlloc (abstract only): "head budgets are reassigned online to high-utility heads, with protection
    against starvation". Utility here is measured on the attention of the last `window` queries (mean over
    the GQA group and the queries, `[B, H, T]`):

    - `"mass"` (default): water-filling. Every head first gets the floor; the remaining slots of the row go,
      one by one, to the (head, token) pairs of largest attention among tokens each head does not yet keep.
      This maximises the attention mass the kept sets cover (the mass outside each head's top-k).
    - `"entropy"`: budgets in proportion to each head's effective support `exp(entropy)` of its attention.

    Per layer the budgets come from `layers` (e.g. `ReasoningWave`); heads of one row always sum to exactly
    `H * layer_budget`. Storage is ragged (memory follows the sum of per-head budgets).

    Args:
        layers: per-layer schedule (None: uniform layers).
        floor: per-head minimum, tokens (int) or a share of the layer budget (float, default 0.25).
        utility: "mass" or "entropy".
        window: queries the utility looks at (ring-buffer size).
        page_size: page size of the ragged storage, tokens.
    """

    uniform = False

    def __init__(self, layers: Allocator | None = None, floor: int | float = 0.25,
                 utility: Literal["mass", "entropy"] = "mass", window: int = 32, page_size: int = 16):
        if layers is not None:
            require_role(layers, Allocator, "HeadUtility(layers=...)", ": layers takes a per-layer allocator "
                         "(e.g. ReasoningWave, Pyramid)")
        if layers is not None and (not layers.uniform or not isinstance(layers, LayerSchedule)):
            raise KVComposeError("HeadUtility: layers must be a per-layer Allocator (e.g. ReasoningWave, Pyramid)")
        if isinstance(floor, bool) or not isinstance(floor, (int, float)):
            raise KVComposeError(f"HeadUtility: floor must be an int or a float share, got {floor!r}")
        if (isinstance(floor, float) and not 0.0 < floor <= 1.0) or (isinstance(floor, int) and floor <= 0):
            raise KVComposeError(f"HeadUtility: floor must be a positive int or a share in (0, 1], got {floor!r}")
        if utility not in ("mass", "entropy"):
            raise KVComposeError(f"HeadUtility: utility must be 'mass' or 'entropy', got {utility!r}")
        if not _is_int(window) or window <= 0:
            raise KVComposeError(f"HeadUtility: window must be a positive int, got {window!r}")
        if not _is_int(page_size) or page_size <= 0:
            raise KVComposeError(f"HeadUtility: bad page size {page_size!r}: a positive int")
        self.layers, self.floor, self.utility, self.window = layers, floor, utility, window
        self.query_window = window
        self.page_size = page_size

    def layer_budget(self, layer_idx: int, num_layers: int, budget: int | None, seen: int) -> int | None:
        if self.layers is None:
            return budget
        return self.layers.layer_budget(layer_idx, num_layers, budget, seen)

    def layer_budgets(self, num_layers: int, budget: int) -> list[int]:
        """The static layer budgets of `layers` (uniform without)."""
        return [budget] * num_layers if self.layers is None else self.layers.layer_budgets(num_layers, budget)

    @property
    def static_schedule(self) -> bool:
        """Layer budgets are a pure function of their arguments when `layers` is (or is None): the heads' split
        is data-dependent, the layers' totals are not."""
        return self.layers is None or bool(getattr(self.layers, "static_schedule", False))

    def floor_tokens(self, budget: int) -> int:
        """The per-head floor at a layer budget."""
        return max(1, _share(self.floor, budget))

    def head_bound(self, budget: int, heads: int) -> int:
        """The most tokens one KV head can be given at a layer budget: the layer's total less the other heads'
        floors, `heads * budget - (heads - 1) * floor` (what an engine that frees memory by a static bound, such
        as vLLM's scheduler, must reserve)."""
        return heads * budget - (heads - 1) * self.floor_tokens(budget)

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        resolve = getattr(self.layers, "resolve", None)  # ReasoningWave(profile="auto") finds its profile
        if resolve is not None:
            resolve(num_layers, num_heads)
        super().check(pipeline, budget, num_layers, num_heads)
        if budget is None:
            return
        for i, b in enumerate(self.layer_budgets(num_layers, budget)):
            f = self.floor_tokens(b)
            if f * num_heads > b * num_heads:
                raise KVComposeError(
                    f"HeadUtility: floor * heads = {f} * {num_heads} > total {b * num_heads} of layer {i}"
                )
            fixed = pipeline.fixed_protection(f)
            if fixed > f:
                raise KVComposeError(
                    f"HeadUtility: a head at its floor ({f} tokens) cannot hold the {fixed} tokens the "
                    "protectors always keep: raise the floor"
                )

    def utilities(self, view: LayerView) -> Float[Tensor, "B H T"] | None:
        """Attention of the last `window` queries per KV head (mean over group and queries), or None."""
        if view.queries is None or view.queries.shape[2] == 0:
            return None
        return window_attention_scores(
            view.queries[:, :, -self.window:], view.keys, view.positions, view.valid,
            view.query_positions[-self.window:], view.query_valid[:, -self.window:], view.scale,
            gqa="mean", pool="none",
        )

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        b, h, t = view.shape
        dev = view.keys.device
        f = self.floor_tokens(budget)
        if f > budget:
            raise KVComposeError(f"HeadUtility: floor * heads = {f} * {h} > total {budget * h}")
        total = h * budget
        p = self.utilities(view)
        if p is None:
            return torch.full((b, h), budget, dtype=torch.long, device=dev)
        p = p.float() * view.valid
        if self.utility == "entropy":
            mass = p.sum(-1, keepdim=True).clamp(min=1e-30)
            q = p / mass
            ent = -(q * q.clamp(min=1e-30).log()).sum(-1)
            eff = ent.exp()  # [B, H], effective number of keys
            raw = f + (total - h * f) * eff / eff.sum(-1, keepdim=True)
            return round_to_total(raw.double(), torch.full((b,), total, dtype=torch.long, device=dev))
        extra = total - h * f
        counts = torch.zeros(b, h, dtype=torch.long, device=dev)
        if t > f and extra > 0:
            s = p.sort(dim=-1, descending=True).values[..., f:]  # [B, H, T - f]: tokens beyond the floor
            n_valid = view.valid.sum(-1, keepdim=True)
            rank = torch.arange(f, t, device=dev)
            s = torch.where(rank[None, None, :] < n_valid, s, torch.full_like(s, -1.0))  # no phantom tokens
            k = min(extra, s.shape[1] * s.shape[2])
            flat = s.reshape(b, -1)
            idx = top_last(flat, k)  # equal utilities: the same (head, rank) pairs whatever the padded width
            head = idx // (t - f)
            useful = flat.gather(-1, idx) >= 0
            counts.scatter_add_(-1, head, useful.long())
        left = total - h * f - counts.sum(-1)  # slots no head can use yet: spread evenly (heads will grow)
        even = left // h
        rest = left - even * h
        bonus = (torch.arange(h, device=dev)[None, :] < rest[:, None]).long()
        return f + counts + even[:, None] + bonus

    def __repr__(self) -> str:
        layers = "" if self.layers is None else f"{self.layers!r}, "
        return f"HeadUtility({layers}floor={self.floor}, utility={self.utility!r}, window={self.window})"


# ------------------------------------------------------------------------------------------- GrowPage
class GrowPage(Allocator):
    """GrowPage: on-demand capacity per request; a request's pages fill, then it takes a page or compresses.

    GrowPage (abstract only, no public code): "per-request budgets grow by pages; fast and slow query
    summaries estimate the attention working set; at a capacity boundary, compress or take a page".
    kvcompose's reading, per layer and per request (batch row); every KV head of a row holds the same number
    of tokens, in pages of `page` tokens:

    - State (the layer's allocator state): a fast and a slow exponential moving average of the post-RoPE
      queries of every query head (`[B, Hq, D]`, rates `fast` and `slow` per decoded token, updated at each
      event from the queries decoded since the last one, which the ring buffer of `window` queries holds
      exactly as long as events are at most `window` tokens apart), the same EMAs of the squared query norms,
      and the pages `[B]` each row holds per KV head.
    - Each timescale summarises the queries as a Gaussian `N(mu, sigma^2 I)` (mean and spread from the two
      EMAs). A query drawn from it gives key `k` the expected softmax numerator
      `exp(s mu.k + s^2 sigma^2 |k|^2 / 2)` (log-normal mean, s the attention scale): a broad query
      distribution reaches more keys than its mean query would (`spread=False` drops the variance term).
    - Working set of a head: the union of the keys covering `coverage` of the fast and of the slow
      expected attention (mean over the query group). A row wants `ceil(working set / page)` pages,
      reduced over its KV heads with `heads` ("max": the broadest head decides, "mean").
    - **Trigger** (`due`, the `EventTrigger` capability): a row is due when its pages are full (some head
      of it holds `pages * page` slots), checked after every forward call, not at fixed interval events.
    - **Decision** at an event, for each due row: a row whose working set needs more pages than it has asks
      for one page; the layer's pool grants requests, largest deficit first, while the cap
      `cap * B * budget / page` pages per KV head across the batch allows. A row that got its page keeps
      every token (it has room again); the others compress to `pages * page - room` tokens, which leaves
      `room` free slots (default one page) before they are due again. With `shrink`, a due row whose working
      set needs at least two pages fewer than it holds returns one page first (the next grant reuses it).
    - Budget of a row = its pages * page size (its memory ceiling per KV head); storage is paged with the
      same page size, so a row's memory follows its pages.

    Args:
        page: tokens per page (16).
        initial: starting pages per row, as a share of the cache budget (0.5) rounded down to pages.
        cap: the layer's pages across the batch, as a multiple of the uniform total `B * budget` tokens per
            KV head (1.0: never more than `Uniform` holds at the same budget after an event).
        floor: fewest pages a row keeps (2: with `room` = one page, a compressed row keeps at least a page).
        room: free slots a compression leaves in the row's pages (None: one page).
        coverage: attention mass the working set must cover (0.9).
        fast: EMA rate of the fast query summary per decoded token (0.25).
        slow: EMA rate of the slow query summary per decoded token (0.01).
        shrink: return pages when the working set narrows.
        window: query ring-buffer size; at least the largest gap between events for exact EMAs.
        spread: include the query spread (variance) in the expected attention.
        heads: how a row's KV heads' page wants are reduced: "max" (default) or "mean".
    """

    uniform = False
    padded_rows = "GrowPage's page pool (its cap) is shared by the batch's rows"

    def __init__(self, page: int = 16, initial: int | float = 0.5, cap: int | float = 1.0, floor: int = 2,
                 room: int | None = None, coverage: int | float = 0.9, fast: float = 0.25, slow: float = 0.01,
                 shrink: bool = True, window: int = 64, spread: bool = True, heads: Literal["max", "mean"] = "max"):
        if not _is_int(page) or page <= 0:
            raise KVComposeError(f"GrowPage: bad page size {page!r}: a positive int of tokens")
        for name, v in (("initial", initial), ("cap", cap)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise KVComposeError(f"GrowPage: {name} must be a positive number, got {v!r}")
        if initial > cap:
            raise KVComposeError(f"GrowPage: initial {initial} exceeds the cap {cap}")
        if not _is_int(floor) or floor <= 0:
            raise KVComposeError(f"GrowPage: floor must be a positive int of pages, got {floor!r}")
        room = page if room is None else room
        if not _is_int(room) or room <= 0:
            raise KVComposeError(f"GrowPage: room must be a positive int of tokens, got {room!r}")
        if room >= floor * page:
            raise KVComposeError(f"GrowPage: room {room} leaves nothing of a row at its floor of {floor} pages of "
                                 f"{page}: lower room or raise floor")
        if not 0.0 < coverage <= 1.0:
            raise KVComposeError(f"GrowPage: coverage must be in (0, 1], got {coverage}")
        if not (0.0 < slow < 1.0 and 0.0 < fast < 1.0):
            raise KVComposeError(f"GrowPage: EMA rates must be in (0, 1), got fast={fast}, slow={slow}")
        if not _is_int(window) or window <= 0:
            raise KVComposeError(f"GrowPage: window must be a positive int, got {window!r}")
        if heads not in ("max", "mean"):
            raise KVComposeError(f"GrowPage: heads must be 'max' or 'mean', got {heads!r}")
        self.page_size = page
        self.initial, self.cap, self.floor, self.room = float(initial), float(cap), floor, room
        self.coverage, self.heads = coverage, heads
        self.fast, self.slow, self.shrink, self.window, self.spread = fast, slow, shrink, window, spread
        self.query_window = window

    # -- sizes ----------------------------------------------------------------------------------------
    def initial_pages(self, budget: int) -> int:
        """Pages a row starts with (per KV head)."""
        return max(self.floor, int(self.initial * budget) // self.page_size)

    def cap_pages(self, budget: int, batch: int) -> int:
        """The layer's pages per KV head across the batch (the global cap): `cap * batch * budget / page`."""
        return int(self.cap * batch * budget) // self.page_size

    def initial_limits(self, budget: int, batch: int, heads: int, device: torch.device) -> Int[Tensor, "B H"]:
        return torch.full((batch, heads), self.initial_pages(budget) * self.page_size, dtype=torch.long, device=device)

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        if budget is None:
            raise KVComposeError("GrowPage needs a budget: the cap is a multiple of the uniform total at that budget")
        _check_budget(budget, "GrowPage")
        if self.page_size > budget:
            raise KVComposeError(f"GrowPage: bad page size {self.page_size}: larger than the budget {budget}")
        init = self.initial_pages(budget)
        if init > self.cap_pages(budget, 1):
            raise KVComposeError(
                f"GrowPage: {init} initial pages per row exceed the cap of {self.cap_pages(budget, 1)} pages per "
                f"row at page size {self.page_size} and budget {budget}: raise the budget or cap, or lower floor"
            )
        least = self.floor * self.page_size - self.room
        fixed = pipeline.fixed_protection(least)
        if fixed > least:
            raise KVComposeError(
                f"GrowPage: a row compressed at its floor keeps {least} tokens ({self.floor} pages of "
                f"{self.page_size} minus room {self.room}), fewer than the {fixed} tokens the protectors always "
                "keep: raise floor or page"
            )

    # -- the trigger ------------------------------------------------------------------------------------
    def due(self, state: Any, lengths: np.ndarray, limits: np.ndarray | None, decoded: int,
            interval: int) -> np.ndarray:
        """Rows whose pages are full: some KV head holds `pages * page` slots (`EventTrigger`); all on the
        host (the page counts are mirrored in the state at every event)."""
        pages = state.get("pages_host") if isinstance(state, dict) else None
        held = np.asarray(lengths).max(-1)
        if pages is not None and pages.shape == held.shape:
            return held >= pages * self.page_size
        if limits is None:
            return np.zeros(held.shape, dtype=bool)
        return held >= np.asarray(limits).max(-1)

    # -- summaries --------------------------------------------------------------------------------------
    @staticmethod
    def _ema_update(state: dict[str, Tensor], name: str, rate: float, q: Float[Tensor, "B Hq W D"],
                    new: Bool[Tensor, "B W"]) -> None:
        """`ema <- (1 - r)^n ema + sum_i r (1 - r)^(n - 1 - i) q_i` over the n new valid queries of each row,
        with the same recursion on the squared query norms and on the total weight (bias correction)."""
        newf = new.float()
        after = newf.flip(-1).cumsum(-1).flip(-1) - newf  # valid new queries after each one
        w = rate * (1.0 - rate) ** after * newf  # [B, W]
        decay = (1.0 - rate) ** newf.sum(-1)  # [B]
        qf = q.float()
        s = torch.einsum("bw,bhwd->bhd", w, qf)
        n = torch.einsum("bw,bhw->bh", w, qf.pow(2).sum(-1))
        if name not in state:
            state[name] = torch.zeros_like(s)
            state[name + "_sq"] = torch.zeros_like(n)
            state[name + "_mass"] = torch.zeros_like(decay)
        state[name] = state[name] * decay[:, None, None] + s
        state[name + "_sq"] = state[name + "_sq"] * decay[:, None] + n
        state[name + "_mass"] = state[name + "_mass"] * decay + w.sum(-1)

    @staticmethod
    def summary(state: dict[str, Tensor], name: str) -> tuple[Float[Tensor, "B Hq D"], Float[Tensor, "B Hq"]]:
        """Mean `mu` and per-dimension variance `sigma^2` of the queries of one timescale (`"fast"`/`"slow"`)."""
        m = state[name + "_mass"].clamp(min=1e-12)[:, None]
        mu = state[name] / m[..., None]
        var = ((state[name + "_sq"] / m - mu.pow(2).sum(-1)) / mu.shape[-1]).clamp(min=0.0)
        return mu, var

    def expected_attention(self, view: LayerView, mu: Float[Tensor, "B Hq D"],
                           var: Float[Tensor, "B Hq"]) -> Float[Tensor, "B H T"]:
        """Attention a query drawn from `N(mu, var I)` gives each held key, in expectation of the softmax
        numerator: `exp(s mu.k + s^2 var |k|^2 / 2)` (log-normal mean), normalised over keys, mean over the
        query group."""
        b, h, t, d = view.keys.shape
        g = mu.shape[1] // h
        k = view.keys.float()
        s = view.scale
        logits = torch.einsum("bhgd,bhtd->bhgt", mu.reshape(b, h, g, d), k) * s
        logits = logits + 0.5 * s * s * var.reshape(b, h, g)[..., None] * k.pow(2).sum(-1)[:, :, None, :]
        ok = (view.valid & (view.positions < view.seen))[:, :, None, :]
        p = torch.softmax(logits.masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)
        return p.mean(2)

    def working_set(self, view: LayerView, state: dict[str, Tensor]) -> Int[Tensor, "B H"]:
        """Keys (per row and KV head) that cover `coverage` of the expected attention of the fast or of the
        slow query summary (the union of the two sets)."""
        b, h, t = view.shape
        union = torch.zeros(b, h, t, dtype=torch.bool, device=view.keys.device)
        if view.queries is None or "fast" not in state:
            return view.valid.sum(-1)
        for name in ("fast", "slow"):
            mu, var = self.summary(state, name)
            union |= _coverage_mask(self.expected_attention(view, mu, var if self.spread else var * 0), self.coverage)
        return union.sum(-1)

    # -- the decision -----------------------------------------------------------------------------------
    def init(self, spec: LayerSpec) -> dict[str, Any]:
        """Empty per-layer state: query summaries and page counts appear at the first event."""
        return {}

    def row_want(self, view: LayerView, state: dict[str, Tensor]) -> Int[Tensor, " B"]:
        """Pages each row wants: its heads' working sets in pages, reduced with `heads`, at least `floor`."""
        pgs = self.page_size
        want = (self.working_set(view, state) + pgs - 1) // pgs  # [B, H]
        row = want.amax(-1) if self.heads == "max" else (want.float().mean(-1).ceil().long())
        return row.clamp(min=self.floor)

    def allocate(self, view: LayerView, budget: int, state: dict[str, Any] | None = None
                 ) -> tuple[Int[Tensor, "B H"], dict[str, Any]]:
        if not isinstance(state, dict):
            raise KVComposeError("GrowPage keeps per-layer state: call it through a Pipeline, which threads it")
        state = dict(state)
        b, h, _ = view.shape
        dev = view.keys.device
        pgs = self.page_size
        if view.queries is not None:
            last = state.get("last", -1)
            new = view.query_valid & (view.query_positions > last)[None, :]
            self._ema_update(state, "fast", self.fast, view.queries, new)
            self._ema_update(state, "slow", self.slow, view.queries, new)
        pages = state.get("pages")
        if pages is None or pages.shape != (b,):
            pages = torch.full((b,), self.initial_pages(budget), dtype=torch.long, device=dev)
        act = torch.ones(b, dtype=torch.bool, device=dev) if view.rows is None else view.rows.to(dev)
        held = (view.positions < FAR_POSITION).sum(-1).amax(-1)  # slots per row (padding included)
        want = self.row_want(view, state)
        zero = torch.zeros((), dtype=torch.long, device=dev)
        returned = zero
        if self.shrink:
            give_back = (want <= pages - 2) & act
            pages = torch.where(give_back, pages - 1, pages).clamp(min=self.floor)
            returned = give_back.sum()
        deficit = (want - pages).clamp(min=0) * (act & (held >= pages * pgs)).long()
        free = (self.cap_pages(budget, b) - pages.sum()).clamp(min=0)
        n_req = (deficit > 0).sum()
        # the first min(free, requests) rows by deficit get a page each (on the device: no host decision)
        order = torch.sort(deficit, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(b, device=dev))
        grant = (rank < torch.minimum(free, n_req)).long()
        pages = pages + grant
        ceiling = pages * pgs
        compress = act & (held >= ceiling)
        out = torch.where(compress, ceiling - self.room, ceiling)
        state["pages"] = pages
        # one host read: the pages (what `due` reads at every step), the budgets, the counters, the newest query
        last_q = view.query_positions[-1:] if view.queries is not None else zero[None] - 1
        got = torch.cat([pages, out, torch.stack([returned, grant.sum(), (n_req - free).clamp(min=0),
                                                  compress.sum()]), last_q.to(torch.long)]).cpu().numpy()
        state["pages_host"] = got[:b].astype(np.int64)
        for i, k in enumerate(("returned", "granted", "denied", "compressed")):
            state[k] = state.get(k, 0) + int(got[2 * b + i])
        if view.queries is not None:
            state["last"] = int(got[-1])
        budgets = out[:, None].expand(b, h).contiguous()
        return with_host(budgets, np.repeat(got[b : 2 * b, None], h, axis=1).astype(np.int64)), state

    def map_rows(self, state: Any, fn, batch: int) -> Any:
        state = super().map_rows(state, fn, batch)
        if isinstance(state, dict) and "pages" in state:
            state = {**state, "pages_host": state["pages"].cpu().numpy()}
        return state

    def __repr__(self) -> str:
        return (f"GrowPage(page={self.page_size}, initial={self.initial:g}, cap={self.cap:g}, room={self.room}, "
                f"coverage={self.coverage:g}, fast={self.fast:g}, slow={self.slow:g}, shrink={self.shrink}, "
                f"spread={self.spread}, heads={self.heads!r})")
