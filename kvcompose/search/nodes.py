"""The search tree's values: a generated step (`Step`), step scorers, the nodes of the tree (`SearchNode`)
and the outcome of a search (`SearchResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jaxtyping import Float, Int
from torch import Tensor

__all__ = ["Step", "StepScorer", "MeanLogProb", "SumLogProb", "SearchNode", "SearchResult"]


@dataclass
class Step:
    """One generated reasoning step.

    Attributes:
        token_ids: `[n]` the step's tokens (ending with the delimiter or end-of-sequence token, if any).
        logprobs: `[n]` log-probability of each token under the model (temperature 1, before sampling
            transforms).
        text: the decoded step (None without a tokenizer).
        depth: 1 for the first step after the prompt.
        finished: the step ended the answer (end-of-sequence token, or the length limit).
    """

    token_ids: Int[Tensor, " n"]
    logprobs: Float[Tensor, " n"]
    text: str | None
    depth: int
    finished: bool


class StepScorer:
    """Values a step (higher = better). Any callable `Step -> float` also works as a scorer."""

    def __call__(self, step: Step) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MeanLogProb(StepScorer):
    """The mean token log-probability of the step (the model's own confidence; length-normalised)."""

    def __call__(self, step: Step) -> float:
        return float(step.logprobs.mean()) if step.logprobs.numel() else -math.inf


class SumLogProb(StepScorer):
    """The total log-probability of the step (favours short steps)."""

    def __call__(self, step: Step) -> float:
        return float(step.logprobs.sum())


@dataclass(eq=False)
class SearchNode:
    """A node of the search tree: the prompt plus the steps on its path.

    Attributes:
        id: creation order (0 = the root, the prompt alone).
        parent: the parent node (None for the root).
        depth: number of steps on the path.
        step: the step that created this node (None for the root).
        score: the step scorer's value of `step` (0 for the root).
        value: the path's value (the aggregate of its steps' scores).
        tokens: `[1, L]` prompt and steps' token ids.
        finished: the path ended the answer.
        handle: the backend's handle of this node's KV (None once dropped).
    """

    id: int
    parent: "SearchNode | None"
    depth: int
    step: Step | None
    score: float
    value: float
    tokens: Int[Tensor, "1 L"]
    finished: bool = False
    handle: Any = None

    def steps(self) -> list[Step]:
        """The steps from the root to this node."""
        out, node = [], self
        while node is not None and node.step is not None:
            out.append(node.step)
            node = node.parent
        return out[::-1]


@dataclass
class SearchResult:
    """The outcome of `TreeSearch.run`.

    Attributes:
        best: the best node at the end (highest value; finished nodes first).
        frontier: the last frontier (BFS) or open set plus finished nodes (best-first).
        nodes: every node created, in creation order.
        decisions: per depth (BFS) or per expansion (best-first), the ids of the nodes kept / expanded.
        prompt_length: tokens of the prompt.
        generated_tokens: tokens generated over the whole search.
        wall_s: wall-clock seconds of the search (prefill included).
        memory: the backend's memory report (bytes; see `Backend.memory`).
    """

    best: SearchNode
    frontier: list[SearchNode]
    nodes: list[SearchNode]
    decisions: list[list[int]]
    prompt_length: int
    generated_tokens: int
    wall_s: float
    memory: dict[str, int] = field(default_factory=dict)

    def decision_tokens(self) -> list[list[tuple[int, ...]]]:
        """The decisions as token sequences (comparable across backends)."""
        by_id = {n.id: n for n in self.nodes}
        return [[tuple(by_id[i].tokens[0].tolist()) for i in ids] for ids in self.decisions]

    def best_tokens(self) -> Int[Tensor, " n"]:
        """The generated part of the best path."""
        return self.best.tokens[0, self.prompt_length:]
