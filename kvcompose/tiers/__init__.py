"""Tier stores: where a token that leaves HBM goes (host memory, a compressed copy, or nowhere).

The memory hierarchy of "Not All Thoughts Need HBM" (abstract only). `base`: the contract and the token
bundle; `transfer`: host <-> device copies (pinned buffers, side stream, events); `host`: `HostTier`;
`compressed`: `CompressedTier` (KIVI int8 / int4); `hierarchy`: `Hierarchy` (host, then compressed, then
evicted, by the pipeline's one ranking).
"""

from .base import Evict, TierStore, TierTokens, flat_index, take_tokens
from .compressed import CompressedTier, quantization_error_bound
from .hierarchy import Hierarchy
from .host import HostTier
from .transfer import HostStash, PendingCopy, transfer_stream

__all__ = ["TierStore", "TierTokens", "Evict", "HostTier", "CompressedTier", "Hierarchy", "HostStash",
           "PendingCopy", "quantization_error_bound", "transfer_stream", "take_tokens", "flat_index"]
