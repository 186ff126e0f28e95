"""Blocks ported from NVIDIA kvpress 0.5.5, one press per file (kvpress's own layout), each in the role it
really has: scorers (`LayerView -> [B, H, T]`), selectors, allocators and the merging part.

- query-free scorers: `KeyDiff` (keydiff), `LagKV` (lagkv), `CUR` (cur), `LeverageScore` (leverage).
- query-window scorers: `ExpectedAttention` (expected_attention), `CAP` (cap), `NonCausalAttention`
  (noncausal), `Compactor` (compactor); `CriticalKV` (critical) wraps any scorer.
- selectors: `CompositeTokens` (composite: KVCompose's aligned per-head selections, structured or not), with its
  score `AggregatedAttention`; ChunkKV is `kvcompose.BlockGranular` (a preset, `methods.chunkkv`).
- allocators (per-head budgets, paged storage): `DuoHeads` (duo: DuoAttention's retrieval / streaming heads),
  `HeadCurves` (lukv: LU-KV's budget curves); both read a profile of `kvcompose calibrate --target duo|lukv`
  (`kvcompose.head_calibration`).
- the merging part (a pipeline role of its own): `Merger`, `MergeSimilar` (merging), `CAM` (cam).
- model data a block may be given (never read from a global): `Rotary` (rotary) for rules defined on
  pre-RoPE vectors, `OutputProjection` (critical) for CriticalKV.

`docs/methods.md` maps every kvpress press to its kvcompose block or preset and says where the rule differs.
"""

from .cam import CAM, DecodeAttention, EventClock
from .cap import CAP
from .compactor import Compactor
from .composite import AggregatedAttention, CompositeTokens
from .critical import CriticalKV, OutputProjection
from .cur import CUR
from .duo import DuoHeads
from .expected_attention import ExpectedAttention
from .keydiff import KeyDiff
from .lagkv import LagKV
from .leverage import LeverageScore
from .lukv import HeadCurves
from .merging import MergeSimilar, Merger
from .noncausal import NonCausalAttention
from .rotary import Rotary

__all__ = ["KeyDiff", "LagKV", "CUR", "LeverageScore", "NonCausalAttention", "Compactor", "CriticalKV",
           "OutputProjection", "ExpectedAttention", "CAP", "Rotary", "Merger", "MergeSimilar", "CAM", "DecodeAttention",
           "EventClock", "CompositeTokens", "AggregatedAttention", "DuoHeads", "HeadCurves"]
