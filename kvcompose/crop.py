"""Rolling a layer (a `ComposeLayer`) back (`crop`): exact, or refused with the reason. `ComposeLayer.crop` and the cache's
`crop` call these; a crop is exact when the layer afterwards is what a fresh cache fed only the tokens before
the crop point holds (see `crop_refusal`)."""

from __future__ import annotations

from typing import Any

import torch

from .view import KVComposeError


def crop_count(layer: Any, tokens_to_remove: int) -> int:
    """How many of the newest tokens `crop(tokens_to_remove)` removes: `-tokens_to_remove` (transformers'
    form), or, for a positive value (the legacy form), all but that many tokens seen."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
        raise KVComposeError(f"crop takes an int, got {tokens_to_remove!r}")
    n = -tokens_to_remove if tokens_to_remove <= 0 else layer.seen - tokens_to_remove
    return max(0, min(n, layer.seen))


def crop_refusal(layer: Any, n: int) -> str | None:
    """Why removing the newest `n` tokens would not leave exactly the layer that a fresh cache fed only the
    tokens before them holds (None: the crop is exact). A crop is exact only when nothing that the removed
    tokens changed outlives them:

    - no compaction since the crop point (a compression event, or a sliding-window cut): what it evicted
      cannot come back, and a fresh run would still hold it;
    - no observer state (H2O's accumulated attention adds every attention step into every held token's
      state; the removed queries' share cannot be taken back out);
    - no query the query ring dropped that a fresh run would still hold at its next compression event.
    """
    if not layer.is_initialized or n <= 0:
        return None
    cfg, pipe, seg = layer.config, layer.config.pipeline, layer.write_segment()
    end = layer.seen - n
    if n > seg.n:
        return f"layer {layer.layer_idx} was written only {seg.n} tokens since its last branch point"
    if layer.compacted_at > end:
        what = "a sliding-window cut" if layer.sliding_window is not None else "a compression event"
        return (f"{what} at token {layer.compacted_at} removed tokens from layer {layer.layer_idx} that a cache "
                f"fed only the first {end} tokens would still hold, and evicted tokens cannot come back: crop at "
                f"most {layer.seen - layer.compacted_at} tokens (to the last event), or copy.deepcopy(cache) at the "
                "point you may return to and continue from the copy")
    if pipe.observers and cfg.observe and layer.sliding_window is None:
        names = ", ".join(sorted({repr(pipe.leaves[i]) for i in pipe.observers}))
        return (f"{names} of the pipeline keeps state from every attention step (e.g. H2O's accumulated "
                "attention of every held token), and the removed tokens' attention cannot be taken back out of "
                "it: copy.deepcopy(cache) at the point you may return to and continue from the copy")
    w = pipe.query_window if layer.sliding_window is None else 0
    if w > 0 and layer.scheduled():
        held = seg.ring.positions
        nxt = next_read(layer, end)
        if held is not None and held.numel() >= w and nxt < layer.seen:
            return (f"layer {layer.layer_idx} keeps its last {w} queries for the pipeline and has dropped older "
                    f"ones that a cache fed only the first {end} tokens would still read at its next compression "
                    f"event (token {nxt}): crop at most {layer.seen - last_read(layer, end)} tokens here, or "
                    "copy.deepcopy(cache) at the point you may return to")
    return None


def next_read(layer: Any, end: int) -> int:
    """The earliest tokens-seen count at which a cache cut back to `end` tokens runs its next compression
    event (and so reads its query ring): the next multiple of the interval of decoded tokens."""
    if layer.config.trigger:
        return end + 1
    prompt = min(layer.prompt_length, end)
    return prompt + ((end - prompt) // layer.config.interval + 1) * layer.config.interval


def last_read(layer: Any, end: int) -> int:
    """The schedule point at or before `seen`: a crop that stays after it never loses a query it needs."""
    prompt = min(layer.prompt_length, end)
    return prompt + max(0, (layer.seen - 1 - prompt) // layer.config.interval) * layer.config.interval


def apply_crop(layer: Any, n: int) -> None:
    """Remove the newest `n` tokens of the write segment (`crop_refusal(n)` must be None)."""
    if not layer.is_initialized or n <= 0:
        return
    seg = layer.write_segment()
    end = layer.seen - n
    lengths = seg.store.lengths
    idx = (lengths[..., None] - n + torch.arange(n, device=layer.device)).clamp(min=0)
    tail = seg.store.view().positions.gather(-1, idx)
    want = torch.arange(end, layer.seen, device=layer.device)
    if n > int(lengths.min()) or not bool((tail == want).all()):  # guarded by compacted_at; never expected
        raise KVComposeError(f"cannot crop {n} tokens: layer {layer.layer_idx} no longer holds all of them")
    if end == 0 and seg.start == 0:
        layer.reset()  # nothing left: exactly a fresh layer (its generator is reseeded at the next token)
        return
    seg.store.crop(n)
    seg.n -= n
    seg.ring.crop(end)
    layer.prompt_length = min(layer.prompt_length, end)
    if layer.padding is not None:  # left padding comes first: a crop into it removes the newest padding
        layer.padding = layer.padding.clamp(max=end)
    layer.config.prefetcher.clear()
