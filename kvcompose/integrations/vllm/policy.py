"""Block-granular eviction policies for a paged KV cache, and the block-table compaction that makes an
attention kernel skip freed blocks. Pure Python and torch: nothing here imports vLLM.

A paged engine (vLLM, SGLang) stores each request's keys and values in fixed-size blocks listed by a block
table; all layers and KV heads of a request share that table. A policy here decides, at a compression event,
which *logical* blocks of one request to free (their table entry becomes the engine's null block); the
compaction then removes those entries from the table the attention kernel reads and shortens the sequence
length by one block each, while the token positions (RoPE) of the queries stay the original ones.

Two policies need no attention scores, so they run inside the engine's scheduler as they are:

* `streaming`: StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention
  Sinks") by blocks: the first `sink_blocks` blocks (the 4 sink tokens, rounded up to a block) and the newest
  blocks up to the budget.
* `random`: Random Attention (SalesforceAIResearch/Random-Attention) by blocks: the prompt (while it leaves
  room), the sink block and the newest `recent` tokens are kept; the others are evicted uniformly at random
  without replacement, redrawn at every event. Unlike the original (independent draws per layer and KV head),
  one draw serves every layer and head, because they share the block table.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor

from ...view import KVComposeError

__all__ = ["BlockPolicy", "POLICIES", "compact_block_table", "request_rng"]

POLICIES = ("streaming", "random")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockPolicy:
    """Which whole blocks of one request to free at a compression event.

    Budgets are in tokens and held per request; with one event per `interval` tokens the request holds
    between `budget` and `budget + interval` tokens (its current, partly filled block included).

    Attributes:
        policy: `"streaming"` (StreamingLLM, Xiao et al. 2023) or `"random"` (Random Attention,
            SalesforceAIResearch/Random-Attention), both by blocks.
        budget: tokens kept per request after an event; a multiple of `block_size`.
        block_size: tokens per block (the engine's; vLLM's CPU kernel needs multiples of 32).
        interval: tokens between events (a multiple of `block_size`; default one block).
        sink_blocks: leading blocks always kept (StreamingLLM's 4 sink tokens live in the first one).
        recent: newest tokens always kept by `random` (Random Attention keeps 64).
        protect_prompt: `random` keeps the prompt's blocks while they leave room for the recent ones.
        seed: base seed of `random` (each request draws from `request_rng(seed, request_id)`).
    """

    policy: str
    budget: int
    block_size: int = 32
    interval: int | None = None
    sink_blocks: int = 1
    recent: int = 64
    protect_prompt: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise KVComposeError(f"unknown block policy {self.policy!r}; choose one of {POLICIES}")
        if self.block_size <= 0:
            raise KVComposeError(f"block_size must be positive, got {self.block_size}")
        if self.budget <= 0 or self.budget % self.block_size:
            raise KVComposeError(
                f"budget must be a positive multiple of block_size={self.block_size} tokens, got {self.budget}"
            )
        interval = self.block_size if self.interval is None else self.interval
        if interval <= 0 or interval % self.block_size:
            raise KVComposeError(
                f"interval must be a positive multiple of block_size={self.block_size}, got {self.interval}"
            )
        if self.sink_blocks < 0 or self.recent < 0:
            raise KVComposeError(f"sink_blocks and recent must be >= 0, got {self.sink_blocks}, {self.recent}")
        need = self.sink_blocks + self.recent_blocks
        if self.budget_blocks < need + (1 if self.policy == "random" else 0):
            raise KVComposeError(
                f"budget={self.budget} holds {self.budget_blocks} blocks of {self.block_size}, fewer than the "
                f"{need} protected ones (sink_blocks={self.sink_blocks}, recent={self.recent}) plus one to choose"
            )

    @property
    def budget_blocks(self) -> int:
        """Blocks kept after an event."""
        return self.budget // self.block_size

    @property
    def interval_blocks(self) -> int:
        """Blocks added between events."""
        return (self.block_size if self.interval is None else self.interval) // self.block_size

    @property
    def recent_blocks(self) -> int:
        """Newest blocks that `random` never evicts: the current, partly filled one and those holding the
        `recent` tokens before it (0 for `streaming`, whose kept blocks are the newest anyway)."""
        return 0 if self.policy == "streaming" else _cdiv(self.recent, self.block_size) + 1

    def plan(self, resident: list[int], num_computed_tokens: int, num_prompt_tokens: int,
             rng: random.Random | None = None) -> list[int]:
        """Logical indices of the blocks to free now (ascending; empty when no event is due).

        Args:
            resident: ascending logical indices of the request's blocks still held.
            num_computed_tokens: tokens whose keys and values are in the cache; the block holding position
                `num_computed_tokens` (the next one written) and any later block are never freed, so
                every freed block is full.
            num_prompt_tokens: prompt length; no event happens before the prompt is computed.
            rng: the request's generator (`request_rng`), needed by `random`.
        """
        if num_computed_tokens < num_prompt_tokens:
            return []
        if len(resident) < self.budget_blocks + self.interval_blocks:
            return []
        writable = num_computed_tokens // self.block_size  # first block that is not full
        full = [i for i in resident if i < writable]
        tail = [i for i in resident if i >= writable]
        n_evict = len(resident) - self.budget_blocks
        if self.policy == "streaming":
            sinks = full[: self.sink_blocks]
            rest = full[self.sink_blocks:]
            keep_recent = max(0, self.budget_blocks - len(sinks) - len(tail))
            kept = set(sinks) | set(rest[len(rest) - keep_recent:] if keep_recent else [])
            return [i for i in full if i not in kept]
        # random
        if rng is None:
            raise KVComposeError("the random block policy needs the request's generator (request_rng)")
        protected = set(full[: self.sink_blocks]) | set(resident[-self.recent_blocks:])
        if self.protect_prompt:
            room = self.budget_blocks - len(protected)
            prompt_blocks = [i for i in full if i * self.block_size < num_prompt_tokens and i not in protected]
            protected |= set(prompt_blocks[: max(0, room - 1)])
        candidates = [i for i in full if i not in protected]
        n_evict = min(n_evict, len(candidates))
        return sorted(rng.sample(candidates, n_evict)) if n_evict > 0 else []


def request_rng(seed: int, request_id: str) -> random.Random:
    """A generator for one request: `seed` mixed with a CRC-32 of the request id (stable across processes,
    unlike Python's `hash`)."""
    return random.Random((int(seed) << 32) ^ zlib.crc32(request_id.encode()))


def compact_block_table(
    block_table: Int[Tensor, "R M"], seq_lens: Int[Tensor, " R"], block_size: int, null_block: int = 0
) -> tuple[Int[Tensor, "R M"], Int[Tensor, " R"], int]:
    """Drop freed (null) blocks from each row of a block table and shorten the sequence lengths to match.

    A paged attention kernel reads `ceil(seq_len / block_size)` entries of each row and masks causally by
    index within that compacted sequence. When the freed blocks are full blocks before the row's last one
    (what `BlockPolicy.plan` guarantees), moving the held entries to the front in their order and
    subtracting `block_size` per freed block gives the kernel exactly the held tokens, oldest first, the
    query still last. Token positions (RoPE) are not touched: they are applied to queries and keys before
    the cache, from the request's original positions. The write slot of the new token is computed by the
    engine from the uncompacted table and the original position, in the last (never freed) block.

    Args:
        block_table: `[R, M]` physical block ids per request row, null entries where blocks were freed.
        seq_lens: `[R]` tokens per row, counting freed ones (the engine's own count).
        block_size: tokens per block.
        null_block: id of the engine's null block (vLLM: 0).

    Returns:
        `(table, seq_lens, n_freed)`: a new `[R, M]` table (the input is not modified), the shortened
        lengths, and the number of freed entries found (0: the inputs are returned unchanged).
    """
    if block_size <= 0:
        raise KVComposeError(f"block_size must be positive, got {block_size}")
    R, M = block_table.shape
    if seq_lens.shape[0] != R:
        raise KVComposeError(f"seq_lens has {seq_lens.shape[0]} rows, block_table {R}")
    n_used = torch.clamp((seq_lens.to(torch.int64) + block_size - 1) // block_size, max=M)
    idx = torch.arange(M, device=block_table.device)
    used = idx[None, :] < n_used[:, None]
    freed = used & (block_table == null_block)
    n_freed_rows = freed.sum(dim=1)
    total = int(n_freed_rows.sum())
    if total == 0:
        return block_table, seq_lens, 0
    # stable sort: held entries first (in order), then freed ones, then the unused tail
    rank = torch.where(used & ~freed, 0, torch.where(freed, 1, 2)).to(torch.int8)
    order = torch.sort(rank, dim=1, stable=True).indices
    table = torch.gather(block_table, 1, order)
    new_lens = (seq_lens.to(torch.int64) - n_freed_rows * block_size).to(seq_lens.dtype)
    return table, new_lens, total
