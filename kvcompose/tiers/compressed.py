"""`CompressedTier`: tokens kept as KIVI int8 / int4 group-quantized copies, dequantized before attention."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..kernels import QTensor, dequantize, quantize
from ..view import KVComposeError
from .base import (TierStore, TierTokens, bump, check_device, map_host_rows, mirror, resolve_device, take_tokens,
                   track)
from .host import _PendingTier
from .transfer import HostStash

__all__ = ["CompressedTier", "quantization_error_bound"]


def quantization_error_bound(
    x: Float[Tensor, "*batch T D"], bits: int, group: int, axis: Literal["channel", "token"]
) -> Float[Tensor, "*batch T D"]:
    """Per-element bound on `|x - dequantize(quantize(x))|` for KIVI min/max group quantization.

    Each group of `group` tokens of one channel (`axis="channel"`, keys) or `group` channels of one token
    (`axis="token"`, values) is mapped to `2^bits` evenly spaced levels between its min and max, so the
    rounding error is at most half a step: `(max - min) / (2^bits - 1) / 2`. Float32 arithmetic adds a few
    ulps, and a half-precision output adds half an ulp of the value (not included here; see docs/tiers.md).
    """
    xf = x.float()
    t, d = xf.shape[-2], xf.shape[-1]
    qmax = float(2**bits - 1)
    if axis == "channel":
        ng = -(-t // group)
        pad = ng * group - t
        xp = torch.cat([xf, xf[..., -1:, :].expand(*xf.shape[:-2], pad, d)], -2) if pad else xf
        xp = xp.reshape(*xf.shape[:-2], ng, group, d)
        step = (xp.amax(-2) - xp.amin(-2)) / qmax
        return (step.repeat_interleave(group, -2)[..., :t, :] / 2)
    ng = -(-d // group)
    pad = ng * group - d
    xp = torch.cat([xf, xf[..., -1:].expand(*xf.shape[:-1], pad)], -1) if pad else xf
    xp = xp.reshape(*xf.shape[:-1], ng, group)
    step = (xp.amax(-1) - xp.amin(-1)) / qmax
    return step.repeat_interleave(group, -1)[..., :d] / 2


class CompressedTier(TierStore):
    """Tokens kept as int8 / int4 group-quantized copies, dequantized before attention.

    KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750):
    keys per channel (one min/max per channel and per group of `key_group` token slots, which tames
    outlier channels), values per token (one min/max per token and per group of `value_group` channels),
    via `kvcompose.kernels.quantize` / `dequantize` (Triton on CUDA). The compressed tier of "Not All
    Thoughts Need HBM" (abstract only: its quantization is not described; this is our choice).

    Layout: `S` quantized slots per row and head, `S` a multiple of `key_group`. At a compression event
    the tokens that were already compressed and stay compressed KEEP their codes (no re-quantization, so
    no drift); newcomers are quantized as a new group-aligned segment (the last group padded with copies
    of a newcomer, which never widen a group's range) appended to the slots; groups whose slots are all
    dead are dropped per row and head (an exact gather). Only if dead slots still pile up
    (`S > slack * N + 2 * key_group`) are the live tokens re-quantized from their dequantized values
    (counted in `state['requantized']`).

    Error: every element is within half a quantization step of its group, `(max - min) / (2^bits - 1) / 2`
    (`quantization_error_bound`), of the value it had when it entered the tier. A promoted token keeps its
    dequantized value; if it is compressed again it is quantized again.

    Args:
        bits: 8 or 4.
        key_group: token slots per key group (power of two, 2..1024); KIVI uses 32-128.
        value_group: channels per value group (power of two, 2..1024).
        location: "host" keeps the codes in host memory (pinned on CUDA, moved compressed, dequantized on
            the device: the hierarchy's order HBM -> host -> compressed); "device" keeps them on the compute
            device. On CPU both are the same memory.
        device: the compute device (None: the layer's device).
        slack: dead-slot tolerance before re-quantizing (see Layout).
        keep_codes: False re-quantizes every held token at every event (compact, but keys drift by up to a
            half-step per event when their group changes).

    Shapes: holds codes `[B, H, S, D]` (8 bits) or `[B, H, S, ceil(D/2)]` (4 bits), float32 key scales and
    zeros `[B, H, S / key_group, D]`, value codes `[B, H, S, Dv or ceil(Dv/2)]` with scales and zeros
    `[B, H, S, ceil(Dv / value_group)]`; fetch returns `[B, H, N, D]` dequantized, in position order.
    """

    holds_tokens = True
    tier_names = ("compressed",)

    def __init__(self, bits: int = 8, key_group: int = 32, value_group: int = 32,
                 location: str = "host", device: str | torch.device | None = None,
                 slack: float = 1.5, keep_codes: bool = True):
        if isinstance(bits, bool) or bits not in (4, 8):
            raise KVComposeError(f"CompressedTier: bits must be 4 or 8, got {bits!r}")
        for name, g in (("key_group", key_group), ("value_group", value_group)):
            if isinstance(g, bool) or not isinstance(g, int) or g < 2 or g > 1024 or g & (g - 1):
                raise KVComposeError(f"CompressedTier: {name} must be a power of two in [2, 1024], got {g!r}")
        if location not in ("host", "device"):
            raise KVComposeError(f"CompressedTier: location must be 'host' or 'device', got {location!r}")
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or slack < 1.0:
            raise KVComposeError(f"CompressedTier: slack must be >= 1, got {slack!r}")
        self.bits, self.key_group, self.value_group, self.location = bits, key_group, value_group, location
        self.slack, self.keep_codes = float(slack), bool(keep_codes)
        self.device = resolve_device(device, "CompressedTier")

    # -- quantization ------------------------------------------------------------------------------
    def _quantize(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]:
        kq = quantize(keys.contiguous(), bits=self.bits, group=self.key_group, axis="channel")
        vq = quantize(values.contiguous(), bits=self.bits, group=self.value_group, axis="token")
        return {"k_codes": kq.codes, "k_scale": kq.scale, "k_zero": kq.zero,
                "v_codes": vq.codes, "v_scale": vq.scale, "v_zero": vq.zero}

    def _dequantize(self, state, parts: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        d, dv, dtype = state["dims"]
        b, h, s = parts["k_codes"].shape[:3]
        kq = QTensor(parts["k_codes"], parts["k_scale"], parts["k_zero"], self.bits, self.key_group, "channel",
                     (b, h, s, d), dtype)
        vq = QTensor(parts["v_codes"], parts["v_scale"], parts["v_zero"], self.bits, self.value_group, "token",
                     (b, h, s, dv), dtype)
        return dequantize(kq), dequantize(vq)

    def _parts(self, state) -> dict[str, Tensor]:
        return state["q"] if "q" in state else state["stash"].get()

    # -- slot bookkeeping ----------------------------------------------------------------------------
    @staticmethod
    def _take_slots(parts: dict[str, Tensor], sidx: Tensor, group: int) -> dict[str, Tensor]:
        """Keep whole key groups: `sidx` [B, H, S'] slot indices made of complete, aligned groups."""
        gidx = sidx[..., ::group] // group
        g = lambda x, i: x.gather(2, i[..., None].expand(*i.shape, x.shape[-1]))  # noqa: E731
        return {"k_codes": g(parts["k_codes"], sidx), "k_scale": g(parts["k_scale"], gidx),
                "k_zero": g(parts["k_zero"], gidx), "v_codes": g(parts["v_codes"], sidx),
                "v_scale": g(parts["v_scale"], sidx), "v_zero": g(parts["v_zero"], sidx)}

    def retained(self, candidates: Int[Tensor, "B H"], kept: Int[Tensor, "B H"], seen: int | Int[Tensor, "B 1"],
                 protected: Int[Tensor, "B H"] | None = None) -> Int[Tensor, "B H"]:
        return (candidates - kept).clamp(min=0)

    def store(self, state, tokens, seen, kept, protected=None):
        dev = tokens.keys.device
        check_device(self.device, dev, "CompressedTier")
        state = dict(state)
        tokens = tokens.sorted()
        G = self.key_group
        b, h, n = tokens.positions.shape
        ar = lambda k: torch.arange(k, device=dev)  # noqa: E731
        old = self._parts(state) if state.get("n") and self.keep_codes else None
        parts: dict[str, Tensor] | None = None
        slot_pos = alive = None
        covered = torch.zeros(b, h, n + 1, dtype=torch.bool, device=dev)
        if old is not None and n:
            # slots whose token stays compressed keep their codes
            sp, al = state["slot_pos"], state["alive"]
            idx = torch.searchsorted(tokens.positions.contiguous(), sp.contiguous()).clamp(max=n - 1)
            hit = al & (tokens.positions.gather(-1, idx) == sp)
            covered.scatter_(-1, idx.masked_fill(~hit, n), True)
            parts, slot_pos, alive = old, sp, hit
        newcomer = ~covered[..., :n]
        c = newcomer.sum(-1)
        # one host read for both widths below: the newcomers per head and the old groups still alive
        old_live = alive.view(b, h, -1, G).any(-1).sum(-1) if alive is not None else torch.zeros_like(c)
        hc, hl = torch.stack([c, old_live]).cpu().numpy() if n else (np.zeros((b, h), np.int64),) * 2
        m = int(hc.max()) if n else 0
        if m:
            m_pad = -(-m // G) * G
            first = torch.where(newcomer, ar(n), n + ar(n)).argsort(dim=-1)[..., :m]  # newcomers first, in order
            last = first.gather(-1, (c - 1).clamp(min=0)[..., None])
            src = torch.cat([first, last.expand(b, h, m_pad - m)], dim=-1)
            src = torch.where(ar(m_pad) < c[..., None], src, last)
            new = self._quantize(take_tokens(tokens.keys, src), take_tokens(tokens.values, src))
            new_pos, new_alive = tokens.positions.gather(-1, src), ar(m_pad).expand(b, h, m_pad) < c[..., None]
            if parts is None:
                parts, slot_pos, alive = new, new_pos, new_alive
            else:
                parts = {k: torch.cat([parts[k], new[k]], dim=2) for k in parts}
                slot_pos, alive = torch.cat([slot_pos, new_pos], -1), torch.cat([alive, new_alive], -1)
        if parts is None or n == 0:
            for k in ("q", "stash", "slot_pos", "alive", "order"):
                state.pop(k, None)
            state.update(n=0, positions=tokens.positions, valid=tokens.valid, channels=tokens.channels)
            mirror(state, tokens.positions, tokens.valid, tokens.counts, tokens.padded)
            bump(state)
            return state
        # drop groups with no live slot (per row and head: an exact gather of whole groups)
        s = alive.shape[-1]
        live_g = alive.view(b, h, s // G, G).any(-1)
        n_live = int((hl + -(-hc // G)).max())  # the old live groups and the newcomers' (read above)
        if n_live < s // G:
            gidx = torch.sort((~live_g).to(torch.int8), dim=-1, stable=True).indices[..., :n_live].sort(-1).values
            sidx = (gidx[..., None] * G + ar(G)).reshape(b, h, n_live * G)
            parts = self._take_slots(parts, sidx, G)
            slot_pos, alive = slot_pos.gather(-1, sidx), alive.gather(-1, sidx)
        state["dims"] = (tokens.keys.shape[-1], tokens.values.shape[-1], tokens.keys.dtype)
        if alive.shape[-1] > self.slack * n + 2 * G:
            # too many dead slots: re-quantize the live tokens (their current, dequantized values)
            order = self._order(tokens.positions, slot_pos, alive)
            k, v = self._dequantize(state, parts)
            n_pad = -(-n // G) * G
            src = torch.cat([ar(n).expand(b, h, n), torch.full((b, h, n_pad - n), n - 1, device=dev)], -1)
            sl = order.gather(-1, src)
            parts = self._quantize(take_tokens(k, sl), take_tokens(v, sl))
            slot_pos, alive = tokens.positions.gather(-1, src), ar(n_pad).expand(b, h, n_pad) < n
            state["requantized"] = state.get("requantized", 0) + 1
        state["slot_pos"], state["alive"] = slot_pos, alive
        state["order"] = self._order(tokens.positions, slot_pos, alive)
        state.update(n=n, positions=tokens.positions, valid=tokens.valid, channels=tokens.channels)
        mirror(state, tokens.positions, tokens.valid, tokens.counts, tokens.padded)
        if self.location == "host" and dev.type == "cuda":
            stash = state.get("stash")
            if stash is None or stash.device != dev:
                stash = HostStash(dev)
                state["stash"] = stash
            stash.put(parts)
            state.pop("q", None)
        else:
            state["q"] = parts
            state.pop("stash", None)
        bump(state)
        track(state, {"compressed": self._nbytes(state)})
        return state

    @staticmethod
    def _order(positions: Tensor, slot_pos: Tensor, alive: Tensor) -> Tensor:
        """`[B, H, N]`: the slot of each held token (tokens in position order)."""
        b, h, n = positions.shape
        tok = torch.searchsorted(positions.contiguous(), slot_pos.contiguous()).clamp(max=n - 1)
        out = torch.zeros(b, h, n + 1, dtype=torch.long, device=positions.device)
        slots = torch.arange(slot_pos.shape[-1], device=positions.device).expand_as(slot_pos)
        out.scatter_(-1, tok.masked_fill(~alive, n), slots)
        return out[..., :n]

    @staticmethod
    def _nbytes(state) -> int:
        if not state.get("n"):
            return 0
        if "q" in state:
            return sum(t.numel() * t.element_size() for t in state["q"].values())
        return state["stash"].nbytes()

    def _assemble(self, state, parts: dict[str, Tensor]) -> TierTokens:
        k, v = self._dequantize(state, parts)
        order = state["order"]
        return TierTokens(take_tokens(k, order), take_tokens(v, order), state["positions"], state["valid"],
                          state["channels"])

    def fetch(self, state) -> TierTokens | None:
        if not state.get("n"):
            return None
        return self._assemble(state, self._parts(state))

    def start_fetch(self, state):
        if not state.get("n") or "stash" not in state:
            return None
        return _PendingTier(self, state, state["stash"].start())

    def write_channels(self, state, channels):
        if not state.get("n"):
            return state
        return {**state, "channels": channels}

    def nbytes(self, state) -> dict[str, int]:
        return {"host": 0, "compressed": self._nbytes(state)}

    def map_rows(self, state, fn, batch):
        if not state.get("n"):
            return state
        state = dict(state)
        # Quantization groups never span rows, so selecting / reordering rows of the codes is exact.
        if "q" in state:
            state["q"] = {k: fn(v) for k, v in state["q"].items()}
        else:
            stash = HostStash(state["stash"].device)
            stash.put({k: fn(v) for k, v in state["stash"].get().items()})
            state["stash"] = stash
        for k in ("positions", "valid", "slot_pos", "alive", "order", "channels"):
            state[k] = fn(state[k])
        state["counts"] = map_host_rows(state.get("counts"), fn)
        bump(state)
        return state

    def __repr__(self) -> str:
        return f"CompressedTier(bits={self.bits}, key_group={self.key_group}, value_group={self.value_group})"
