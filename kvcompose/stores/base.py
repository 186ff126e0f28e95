"""The storage protocol every layer layout implements, and the bundle of tokens a store hands out.

A store holds one layer's tokens of one segment (the whole cache, or one node of a search tree): keys
(after RoPE), values, each token's original position and padding flag, and the float32 channels of
token-aligned block state (e.g. H2O's accumulated attention), which follow their tokens through every
operation. Stores know nothing of scoring, blocks or the layer that drives them.

Shapes: B batch rows, H KV heads, T slots of the padded view (the longest (row, head)), D / Dv key / value
head dims, C channels of token-aligned block state, Q new tokens, K kept slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..view import FAR_POSITION

__all__ = ["StoreView", "KVStore", "FAR_POSITION"]


class StoreView(NamedTuple):
    """A padded view of a store's tokens: `keys [B, H, T, D]`, `values [B, H, T, Dv]`, `positions
    [B, H, T]` (ascending along T; `FAR_POSITION + t` past a head's length) and `valid [B, H, T]` (False
    for left padding and for slots past a head's length)."""

    keys: Float[Tensor, "B H T D"]
    values: Float[Tensor, "B H T Dv"]
    positions: Int[Tensor, "B H T"]
    valid: Bool[Tensor, "B H T"]


@runtime_checkable
class KVStore(Protocol):
    """One layer's tokens in one layout (`DenseStore`: one length per layer; `PagedStore`: a length per
    (row, KV head), pages from a pool). The layer core (`kvcompose.layer`) drives either through this
    protocol only, and a store owns attention over its own layout (`attend`).

    Host mirrors: every size the core needs on the host (`held`, `capacity`, `host_lengths`, `ragged`,
    `padded`) is kept on the host by the store itself, so an ordinary decode step (`append`, `attend`,
    `read_channels` / `write_channels`) never waits for the device. Operations of a compression event
    (`compact`, `assign`, `valid_counts`) may synchronise.

    Indices handed to `compact` and read from `view` are slots of the padded view, per (row, head).
    """

    batch: int
    heads: int
    channels: int

    @property
    def held(self) -> int:
        """T: slots of the padded view (the longest (row, head)), from the host mirror."""

    @property
    def capacity(self) -> int:
        """Token slots of the device buffers (pages x page size for a page pool)."""

    @property
    def lengths(self) -> Int[Tensor, "B H"]:
        """Tokens held per (row, KV head), on the device."""

    @property
    def host_lengths(self) -> np.ndarray:
        """The same counts mirrored on the host (int64 `[B, H]`; never synchronises)."""

    @property
    def ragged(self) -> bool:
        """True when the view has slots that are not real tokens (padding or unequal head lengths):
        attention must then be masked."""

    @property
    def padded(self) -> bool:
        """True when some held token is padding (valid False)."""

    def append(self, keys: Float[Tensor, "B H Q D"], values: Float[Tensor, "B H Q Dv"],
               start: int | Int[Tensor, " Q"], valid: Bool[Tensor, "B Q"] | None = None) -> None:
        """Append Q new tokens after every (row, head)'s own length, at positions `start .. start + Q - 1`
        (or the given positions); their channels start at 0."""

    def attend(self, query: Float[Tensor, "B Hq Q D"], seen: int, scale: float,
               sliding_window: int | None = None, softcap: float | None = None,
               sinks: Float[Tensor, " Hq"] | None = None) -> Float[Tensor, "B Q Hq Dv"]:
        """Attention of queries at positions `seen - Q .. seen - 1` over the held tokens, in this layout
        (`kvcompose.attention_math`'s mask rule: unmasked for one query over real, equally long heads)."""

    def view(self) -> StoreView:
        """The held tokens as a padded view (no copy where the layout allows; a transient copy otherwise,
        never kept by the store)."""

    def valid_counts(self) -> Int[Tensor, "B H"]:
        """Real (non-padding) tokens held per (row, KV head), on the device."""

    def read_channels(self) -> Float[Tensor, "B H T C"]:
        """Token-aligned block state of the held tokens (zeros past a head's length)."""

    def write_channels(self, x: Float[Tensor, "B H T C"]) -> None:
        """Replace the token-aligned block state of the held tokens."""

    def set_tail_valid(self, valid: Bool[Tensor, "B Q"]) -> None:
        """Set the padding flags of the newest Q tokens of every head of each row (called only for new tokens
        that include padding: the store counts as padded from then on)."""

    def kept_counts(self, kept: Int[Tensor, "B H K"]) -> Int[Tensor, "B H"]:
        """How many tokens each (row, head) holds after `compact(kept)`, on the device (an event reads them
        with its other host values and hands them to `compact`)."""

    def compact(self, kept: Int[Tensor, "B H K"], counts: np.ndarray | None = None) -> None:
        """Keep the view slots `kept` (ascending, -1 padded) of every (row, head); free the rest. `counts`:
        `kept_counts(kept)` on the host when the caller has them (else the store reads them: a host sync)."""

    def assign(self, view: StoreView, channels: Float[Tensor, "B H T C"] | None,
               lengths: Int[Tensor, "B H"], host_lengths: np.ndarray | None = None,
               padded: bool | None = None) -> None:
        """Replace the content by the first `lengths[b, h]` slots of a padded view. `host_lengths`: the same
        on the host; `padded`: whether some of those slots are padding, when the caller knows (else the store
        reads it: a host sync)."""

    def fit(self, room: int) -> None:
        """Free memory after a compression event, keeping room for `room` more tokens per (row, head) (what
        the layer appends until its next event): dense buffers shrink to `held + room` slots, a page pool to
        the pages its heads need for that many more tokens each (defragmenting it)."""

    def crop(self, n: int) -> None:
        """Drop the newest `n` slots of every (row, head)."""

    def trim(self) -> None:
        """Free spare capacity (slots or pages beyond the tokens held)."""

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Reorder / select / repeat batch rows (`fn` acts on dim 0 of every tensor)."""

    def nbytes(self) -> int:
        """Bytes of the K/V of the tokens held."""

    def allocated_bytes(self) -> int:
        """Bytes of the K/V buffers (held tokens plus free slots or pages)."""
