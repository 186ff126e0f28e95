"""KeyDiff: keep the tokens whose keys differ most from the mean key direction (query-free).

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv 2504.15364; kvpress's `KeyDiffPress`.
"""

from __future__ import annotations

import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from ..scorers import Scorer
from ..view import LayerView

__all__ = ["KeyDiff"]


class KeyDiff(Scorer):
    """`-cos(k_t, a)`, `a` the mean of the L2-normalised keys of the (row, KV head): distinctive keys score high.

    The same rule as kvpress's `KeyDiffPress` (the anchor is the mean over the real tokens only, so padding
    never moves it). The paper scores block by block while the prompt streams in (kvpress's `BlockPress`);
    during decoding kvcompose rescores every held token at each event, which is that loop with the block
    being the tokens decoded since the last event. Needs no query: `query_window = 0`.

    Shapes: `view.keys [B, H, T, D]` -> `[B, H, T]`.
    """

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        keys = view.keys.float()
        m = view.valid[..., None].float()
        anchor = (F.normalize(keys, p=2, dim=-1) * m).sum(2, keepdim=True) / m.sum(2, keepdim=True).clamp(min=1)
        return (-F.cosine_similarity(keys, anchor, dim=-1)).masked_fill(~view.valid, 0.0)

    def __repr__(self) -> str:
        return "KeyDiff()"
