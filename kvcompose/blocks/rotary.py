"""`Rotary`: a model's rotary position embedding (RoPE) as a plain value a block can be given.

kvcompose holds keys and records queries *after* RoPE (evicting never re-rotates). A few rules of kvpress
presses are defined on pre-RoPE vectors (ExpectedAttention and CAP average the queries before RoPE and
rotate the average by the mean rotation of the next positions; LeverageScore and Compactor sketch the
pre-RoPE keys). A block that needs that takes a `Rotary` at construction: the inverse frequencies and the
attention scaling of the model's rotary embedding, exactly what transformers' `*RotaryEmbedding.forward`
uses, so `rotate` matches the model's own `apply_rotary_pos_emb` and `unrotate` inverts it. It is static
data of the model (like a weight), never layer state, and it reads nothing global.

Shapes: `*` any leading dims, N positions, D head dim (the rotary dim: partial-rotary models are refused).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..view import KVComposeError

__all__ = ["Rotary"]


def _rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Rotary:
    """A rotary position embedding: `x -> s * (x cos(p f) + rotate_half(x) sin(p f))` per position `p`.

    Args:
        inv_freq: `[D/2]` inverse frequencies (transformers' `rotary_emb.inv_freq`).
        scaling: the attention scaling transformers multiplies cos and sin by (1.0 for default RoPE; YaRN and
            LongRoPE use other values).
    """

    def __init__(self, inv_freq: Float[Tensor, " F"], scaling: float = 1.0):
        if not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or inv_freq.numel() == 0:
            raise KVComposeError("Rotary: inv_freq must be a non-empty 1-D tensor of inverse frequencies")
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
            raise KVComposeError(f"Rotary: scaling must be a positive number, got {scaling!r}")
        self.inv_freq = inv_freq.detach().float().cpu()
        self.scaling = float(scaling)

    @property
    def dim(self) -> int:
        """The head dim it rotates (2 * frequencies)."""
        return 2 * self.inv_freq.numel()

    @staticmethod
    def from_model(model) -> "Rotary":
        """The rotary embedding of a Hugging Face model (the first module that has `inv_freq`, e.g.
        `model.model.rotary_emb`). Raises `KVComposeError` for a model without one."""
        for name, mod in model.named_modules():
            inv = getattr(mod, "inv_freq", None)
            if isinstance(inv, Tensor):
                return Rotary(inv, float(getattr(mod, "attention_scaling", 1.0) or 1.0))
        raise KVComposeError(f"{type(model).__name__} has no rotary embedding (no module with `inv_freq`)")

    @staticmethod
    def default(head_dim: int, theta: float = 10000.0) -> "Rotary":
        """Plain RoPE (`inv_freq = theta ** -(2i / D)`), as transformers' default rope type computes it."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise KVComposeError(f"Rotary.default: head_dim must be a positive even int, got {head_dim!r}")
        return Rotary(1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)))

    def _check(self, d: int) -> None:
        if d != self.dim:
            raise KVComposeError(f"Rotary rotates {self.dim} dims but the vectors have {d} (partial rotary models "
                                 "are not supported)")

    def cos_sin(self, positions: Int[Tensor, "*P"], device: torch.device | None = None
                ) -> tuple[Float[Tensor, "*P D"], Float[Tensor, "*P D"]]:
        """cos and sin `[..., D]` at integer positions, float32, as the model's rotary embedding computes them."""
        dev = positions.device if device is None else device
        freqs = positions.to(dev)[..., None].float() * self.inv_freq.to(dev)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def rotate(self, x: Float[Tensor, "*B N D"], positions: Int[Tensor, "*P N"]) -> Float[Tensor, "*B N D"]:
        """RoPE of pre-RoPE vectors `x` at `positions` (broadcast against x's leading dims)."""
        self._check(x.shape[-1])
        cos, sin = self.cos_sin(positions, x.device)
        xf = x.float()
        return xf * cos + _rotate_half(xf) * sin

    def unrotate(self, x: Float[Tensor, "*B N D"], positions: Int[Tensor, "*P N"]) -> Float[Tensor, "*B N D"]:
        """The pre-RoPE vectors of post-RoPE `x` at `positions` (the inverse of `rotate`)."""
        self._check(x.shape[-1])
        cos, sin = self.cos_sin(positions, x.device)
        xf = x.float()
        return (xf * cos - _rotate_half(xf) * sin) / (self.scaling * self.scaling)

    def mean_rotation(self, start: int, n: int, device: torch.device | None = None) -> Float[Tensor, "D D"]:
        """The mean of the RoPE matrices of positions `start .. start + n - 1` (`R x = rotate(x)`): kvpress's
        "average RoPE" of the next `n` positions (ExpectedAttention, CAP)."""
        if n <= 0:
            raise KVComposeError(f"Rotary.mean_rotation: n must be positive, got {n}")
        d = self.dim
        dev = self.inv_freq.device if device is None else device
        cos, sin = self.cos_sin(torch.arange(start, start + n, device=dev), dev)
        eye = torch.eye(d, device=cos.device)
        p = torch.zeros(d, d, device=cos.device)
        h = d // 2
        p[h:, :h] = torch.eye(h, device=cos.device)
        p[:h, h:] = -torch.eye(h, device=cos.device)
        return (cos[:, None, :] * eye + sin[:, None, :] * p).mean(0)

    def __repr__(self) -> str:
        s = "" if self.scaling == 1.0 else f", scaling={self.scaling:g}"
        return f"Rotary(dim={self.dim}{s})"
