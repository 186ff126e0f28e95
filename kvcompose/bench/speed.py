"""Decode speed: tokens/s over a long greedy generation, peak KV bytes, and the share of decoding time spent
in compression events, for the full cache and each method, as ratios to the full cache of the same run.

Compression time is measured by `TimedCache`, a `KVComposeCache` whose layers (`TimedLayer`) time their own
`compress()` calls; nothing in transformers is patched. Decode time is taken from a streamer: from the
first generated token (after the prefill) to the last, so the prefill is not counted.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..cache import KVComposeCache, KVComposeLayer
from ..pipeline import Selection

__all__ = ["TimedCache", "TimedLayer", "SpeedResult", "measure_decode", "TokenClock"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedLayer(KVComposeLayer):
    """A `KVComposeLayer` that adds the wall time of each `compress()` call to its cache's counters."""

    def compress(self) -> Selection:
        cache = self.cache
        _sync(self.device)
        t0 = time.perf_counter()
        try:
            return super().compress()
        finally:
            _sync(self.device)
            cache.compress_seconds += time.perf_counter() - t0
            cache.compress_calls += 1


class TimedCache(KVComposeCache):
    """`KVComposeCache` with per-call timing of compression events (`compress_seconds`, `compress_calls`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.layers = [TimedLayer(self, i) for i in range(self.num_layers)]
        self.compress_seconds = 0.0
        self.compress_calls = 0


class TokenClock:
    """A generate streamer that stamps each generated token (and can tick a tqdm bar)."""

    def __init__(self, device: torch.device, bar=None):
        self.device, self.bar = device, bar
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first hands over the prompt
            self._prompt_seen = True
            return
        _sync(self.device)
        self.stamps.append(time.perf_counter())
        if self.bar is not None:
            self.bar.update(1)

    def end(self) -> None:
        pass

    @property
    def decode_seconds(self) -> float:
        return self.stamps[-1] - self.stamps[0] if len(self.stamps) > 1 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.stamps) - 1) / self.decode_seconds if len(self.stamps) > 1 else float("nan")


@dataclass
class SpeedResult:
    name: str
    budget: int | None
    new_tokens: int
    decode_seconds: float
    tokens_per_s: float
    compress_seconds: float
    compress_calls: int
    compress_share: float
    peak_kv_bytes: int
    peak_alloc_bytes: int
    full_kv_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def measure_decode(model, input_ids: torch.Tensor, cache, new_tokens: int, name: str = "",
                   progress: bool = False) -> SpeedResult:
    """Greedy-decode exactly `new_tokens` tokens into `cache` (a `TimedCache`, a `KVComposeCache` or a
    transformers cache) and time the decode steps."""
    from tqdm.auto import tqdm

    device = input_ids.device
    bar = tqdm(total=new_tokens, desc=f"speed {name}", unit="tok", leave=False, disable=not progress)
    clock = TokenClock(device, bar)
    model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), past_key_values=cache,
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, temperature=None,
                   top_p=None, top_k=None, streamer=clock,
                   pad_token_id=model.generation_config.pad_token_id)
    bar.close()
    comp = float(getattr(cache, "compress_seconds", 0.0))
    calls = int(getattr(cache, "compress_calls", 0))
    if isinstance(cache, KVComposeCache):
        mem = cache.memory()
        peak, alloc, full = int(mem.peak["hbm"]), int(mem.peak["allocated"]), int(mem.full_cache)
    else:
        full = sum(l.keys.numel() * l.keys.element_size() * 2 for l in cache.layers if l.keys is not None)
        peak = alloc = full
    dec = clock.decode_seconds
    return SpeedResult(
        name=name, budget=getattr(cache, "budget", None), new_tokens=len(clock.stamps), decode_seconds=dec,
        tokens_per_s=clock.decode_tokens_per_s, compress_seconds=comp, compress_calls=calls,
        compress_share=comp / dec if dec and dec == dec else float("nan"),
        peak_kv_bytes=peak, peak_alloc_bytes=alloc, full_kv_bytes=full,
    )
