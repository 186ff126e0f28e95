"""CriticalKV: rescale any score by the L1 norm of the value's output-projection, in two stages.

Feng et al., "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective",
arXiv 2502.03805; kvpress's `CriticalKVPress`.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..block import Block
from ..scorers import Scorer
from ..fingerprint import same_weights, weights_sample
from ..kernels.ref import top_last
from ..view import KVComposeError, LayerView

__all__ = ["OutputProjection", "CriticalKV"]


def _o_proj_weights(model) -> tuple[list[Tensor], int]:
    """`(o_proj.weight of every decoder layer, query heads)` of a Hugging Face model (Llama-style attention)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    mods = [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "o_proj")]
    if len(mods) != config.num_hidden_layers:
        raise KVComposeError(f"OutputProjection: found {len(mods)} attention modules with o_proj, the model has "
                             f"{config.num_hidden_layers} layers")
    return [m.o_proj.weight for m in mods], config.num_attention_heads


class OutputProjection:
    """The attention output projections `W_o` of a model, one per decoder layer, as `[Hq, Dv, hidden]` views
    (no copy: the model's own weights). Static model data a block is given, like `Rotary`.

    It holds references to the weights, never a copy of them: `copy.deepcopy`, `pickle` and `torch.save` (of it,
    of a pipeline or of a cache that holds it, or a vLLM config that pickles the pipeline) keep only its shapes and
    a small sample of the weights (`kvcompose.fingerprint.weights_sample`), and the copy takes the weights again from the
    model it is used with (`bind(model)`, which a cache calls with its model: when it is built, and by
    `cache.bind(model)`). A model whose `o_proj` weights differ from the ones it was made from (another model of the
    same shape) is refused there.

    Args:
        weights: per layer, `o_proj.weight` (`[hidden, Hq * Dv]`, nn.Linear's layout).
        heads: query heads Hq.
    """

    def __init__(self, weights: list[Tensor], heads: int):
        if not weights or not all(isinstance(w, Tensor) and w.dim() == 2 for w in weights):
            raise KVComposeError("OutputProjection: give one 2-D o_proj weight per layer")
        if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0 or weights[0].shape[1] % heads:
            raise KVComposeError(f"OutputProjection: {heads!r} query heads do not divide the weight width "
                                 f"{weights[0].shape[1]}")
        self.heads = heads
        self.shapes = [tuple(w.shape) for w in weights]
        self.sample = weights_sample(weights)
        self._weights: list[Tensor] | None = [w.detach() for w in weights]

    @staticmethod
    def from_model(model) -> "OutputProjection":
        """`o_proj` of every decoder layer of a Hugging Face model (Llama-style attention modules)."""
        weights, heads = _o_proj_weights(model)
        return OutputProjection(weights, heads)

    def bind(self, model) -> None:
        """Take references to `model`'s `o_proj` weights; refuse a model whose weights are not the ones this was
        made from (`KVComposeError`)."""
        weights, heads = _o_proj_weights(model)
        if heads != self.heads or [tuple(w.shape) for w in weights] != self.shapes:
            raise KVComposeError(f"OutputProjection: made for {len(self.shapes)} layers of o_proj {self.shapes[0]} and "
                                 f"{self.heads} query heads, the model has {len(weights)} of "
                                 f"{tuple(weights[0].shape) if weights else None} and {heads}: build it from this "
                                 "model (criticalkv(model=model))")
        if not same_weights(self.sample, weights_sample(weights)):
            raise KVComposeError("OutputProjection: made from another model's o_proj weights (a model of the same "
                                 "shape; their samples differ): build it from the model the cache decodes with "
                                 "(criticalkv(model=model))")
        self._weights = [w.detach() for w in weights]

    @property
    def bound(self) -> bool:
        """True when it holds the weights (False for a copy or a loaded one before `bind(model)`)."""
        return self._weights is not None

    @property
    def weights(self) -> list[Tensor]:
        """Per layer, `o_proj.weight` (references to the model's own)."""
        if self._weights is None:
            raise KVComposeError("OutputProjection holds no weights: it was copied or loaded (copies never copy "
                                 "model weights); a cache binds it to its model (KVComposeCache(model, ...), "
                                 "cache.bind(model)), or call pipeline.bind_model(model)")
        return self._weights

    def __getstate__(self) -> dict:
        """copy.deepcopy / pickle / torch.save: the shapes and the sample, never the weights."""
        return {**self.__dict__, "_weights": None}

    def head_weights(self, layer: int) -> Float[Tensor, "Hq Dv E"]:
        """`W_o` of a layer split per query head: `[Hq, Dv, hidden]`."""
        if not 0 <= layer < len(self.shapes):
            raise KVComposeError(f"OutputProjection holds {len(self.shapes)} layers, not layer {layer}")
        w = self.weights[layer]
        return w.t().reshape(self.heads, w.shape[1] // self.heads, w.shape[0])

    def value_norm(self, values: Float[Tensor, "B H T Dv"], layer: int) -> Float[Tensor, "B H T"]:
        """`|v W_o^h|_1` of every value, per query head h of its group, averaged over the group (kvpress's
        `vwl1norm`), computed head by head to bound memory."""
        wo = self.head_weights(layer)
        b, h, t, dv = values.shape
        g = self.heads // h
        out = []
        for head in range(self.heads):
            v = values[:, head // g].to(wo.dtype)
            out.append((v @ wo[head].to(values.device)).norm(p=1, dim=-1).float())
        return torch.stack(out, 1).reshape(b, h, g, t).mean(2)

    def __repr__(self) -> str:
        return f"OutputProjection(layers={len(self.shapes)}, heads={self.heads})"


class CriticalKV(Scorer):
    """Two stages over an inner scorer `s`: the top `first_stage * budget` tokens of each (row, KV head) by `s`
    are kept for sure (scored at the float maximum); the others are ranked by `(s + epsilon) * |v W_o|_1`
    (the L1 norm of each value through the layer's output projection, mean over the query group).

    The same rule as kvpress's `CriticalKVPress`, where the budget is the number of tokens the call keeps; here
    it is the cache's budget at the event (`view.cache_budget`; with a per-layer or per-head allocator that
    is the average, not that head's budget). Without a cache budget the first stage is skipped.

    Args:
        inner: the base scorer (kvpress's default pairing is ExpectedAttention without its value norm).
        projection: the model's output projections (`OutputProjection.from_model(model)`).
        epsilon: added to the inner score before rescaling (1e-4).
        first_stage: share of the budget chosen by the inner score alone (0.5).

    Shapes: values `[B, H, T, Dv]` -> `[B, H, T]`.
    """

    def __init__(self, inner: Scorer, projection: OutputProjection, epsilon: float = 1e-4, first_stage: float = 0.5):
        if not isinstance(inner, Scorer):
            raise KVComposeError(f"CriticalKV wraps a kvcompose Scorer, got {type(inner).__name__}")
        if not isinstance(projection, OutputProjection):
            raise KVComposeError("CriticalKV needs the model's output projections: OutputProjection.from_model(model)")
        if isinstance(first_stage, bool) or not isinstance(first_stage, (int, float)) or not 0 <= first_stage <= 1:
            raise KVComposeError(f"CriticalKV: first_stage must be in [0, 1], got {first_stage!r}")
        self.inner, self.projection = inner, projection
        self.epsilon, self.first_stage = float(epsilon), float(first_stage)

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.inner.query_window

    def children(self) -> tuple[Block, ...]:
        return (self.inner,)

    def bind_model(self, model) -> None:
        """Take the model's output projections (a copied or loaded pipeline holds none); refuse another model's."""
        self.projection.bind(model)

    def score(self, view: LayerView, state: Any = None) -> Float[Tensor, "B H T"]:
        inner_state = state[0] if isinstance(state, tuple) else None
        s = self.inner(view, inner_state)
        t = s.shape[-1]
        top = None
        if view.cache_budget is not None and self.first_stage > 0:
            k = min(t, max(1, int(view.cache_budget * self.first_stage)))
            top = top_last(s.masked_fill(~view.valid, float("-inf")), k)
        out = (s + self.epsilon) * self.projection.value_norm(view.values, view.layer_idx)
        if top is not None:
            out = out.scatter(-1, top, torch.finfo(out.dtype).max)
        return out.masked_fill(~view.valid, 0.0)

    def __repr__(self) -> str:
        return f"CriticalKV({self.inner!r}, epsilon={self.epsilon:g}, first_stage={self.first_stage:g})"
