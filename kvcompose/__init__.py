"""kvcompose: composable KV-cache compression for long chain-of-thought decoding.

```python
from kvcompose import KVComposeCache, Pipeline, ProtectPrompt, ProtectValueNorm, RandomDrop, methods

cache = KVComposeCache(model, Pipeline(ProtectPrompt(), ProtectValueNorm(), RandomDrop()), budget=1024)
model.generate(**inputs, past_key_values=cache)
```
"""

from . import methods
from .allocators import Allocator, GrowPage, HeadUtility, Pyramid, ReasoningWave, SeenShare, Uniform
from .block import Block, LayerSchedule, Observer
from .cache import CacheStats, KVComposeCache, MemoryReport
from .layer import ComposeLayer
from .branch import BranchCache, BranchMemory
from .pipeline import Pipeline, Selection
from .prefetch import Prefetcher
from .protectors import Protector, ProtectPrompt, ProtectRecent, ProtectSinks, ProtectValueNorm
from .scorers import (
    AccumulatedAttention,
    ProjectedNorm,
    KeyNorm,
    KeyRedundancy,
    LastQueryAttention,
    RandomScore,
    Recency,
    Scorer,
    ValueNorm,
    WindowedAttention,
)
from .selectors import BlockGranular, RandomDrop, Sample, Selector, TopK
from .stores import DenseStore, KVStore, PagedStore
from .tiers import CompressedTier, Evict, Hierarchy, HostTier, TierStore, TierTokens
from .view import AttentionStep, KVComposeError, LayerSpec, LayerView
from . import blocks
from .blocks import (CAP, CUR, Compactor, CriticalKV, ExpectedAttention, KeyDiff, LagKV, LeverageScore,
                     NonCausalAttention, OutputProjection, Rotary)
from .view import KVComposeWarning

__version__ = "0.1.0"

__all__ = [
    "KVComposeCache", "ComposeLayer", "MemoryReport", "CacheStats", "Pipeline", "Selection", "LayerView",
    "LayerSpec", "AttentionStep", "KVComposeError", "Block", "Observer", "LayerSchedule",
    "KVStore", "DenseStore", "PagedStore", "SeenShare",
    "Scorer", "AccumulatedAttention", "WindowedAttention", "KeyRedundancy", "ValueNorm", "KeyNorm",
    "LastQueryAttention", "Recency", "RandomScore", "ProjectedNorm",
    "Protector", "ProtectPrompt", "ProtectSinks", "ProtectRecent", "ProtectValueNorm",
    "Selector", "TopK", "Sample", "RandomDrop", "BlockGranular",
    "Allocator", "Uniform", "TierStore", "Evict", "Prefetcher", "methods",
    "Pyramid", "ReasoningWave", "HeadUtility", "GrowPage",
    "HostTier", "CompressedTier", "Hierarchy", "TierTokens",
    "BranchCache", "BranchMemory",
    "blocks", "KeyDiff", "LagKV", "CUR", "LeverageScore", "NonCausalAttention", "Compactor", "CriticalKV",
    "ExpectedAttention", "CAP", "Rotary", "OutputProjection",
    "KVComposeWarning",
]
