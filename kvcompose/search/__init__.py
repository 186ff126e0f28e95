"""Tree search over reasoning steps on a branch-aware KV cache (`kvcompose.branch.BranchCache`).

A *step* is the text a model generates up to a delimiter (e.g. "\\n") or a fixed number of tokens. The
search keeps a tree of partial trajectories; a pluggable step scorer (default: the mean log-probability
of the step's tokens) values each new step, and a path's value aggregates its steps' scores.

- `strategy="bfs"`: Tree-of-Thoughts breadth-first search (Yao et al., "Tree of Thoughts", NeurIPS 2023,
  arXiv 2305.10601): at each depth every frontier node is expanded into `expand` sampled steps (the root
  into `root_expand`), and the `width` best candidates form the next frontier (a step-level beam).
- `strategy="best_first"`: expand the best open node anywhere in the tree (backtracking), up to
  `max_expansions` expansions, with at most `width * expand` open nodes.

Where each branch's KV lives is a `Backend`: `SharedKV` (one `BranchCache`: shared prefixes stored once,
inactive branches compressed and lazily rehydrated, ArborKV-style) or `CopiedKV` (the naive baseline: one
`DynamicCache` per branch, a deep copy at every fork). With the same seed, both backends take the same
search decisions as long as nothing is evicted (`SearchResult.decision_tokens()` compares them).

Steps are decoded with `model.generate(past_key_values=...)` on the active branch; sampling draws from a
generator seeded per search node (the global RNG is restored afterwards), so a run is reproducible.
"""

from .backends import Backend, CopiedKV, SharedKV
from .nodes import MeanLogProb, SearchNode, SearchResult, Step, StepScorer, SumLogProb
from .tree import TreeSearch, delimiter_token_ids

__all__ = [
    "Step", "StepScorer", "MeanLogProb", "SumLogProb", "SearchNode", "SearchResult", "Backend", "SharedKV",
    "CopiedKV", "TreeSearch", "delimiter_token_ids",
]
