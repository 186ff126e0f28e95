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

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .view import KVComposeError

__all__ = [
    "Step", "StepScorer", "MeanLogProb", "SumLogProb", "SearchNode", "SearchResult", "Backend", "SharedKV",
    "CopiedKV", "TreeSearch",
]


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


# ------------------------------------------------------------------------------------------------
# backends: where each branch's KV lives
# ------------------------------------------------------------------------------------------------
class Backend:
    """Holds the KV of every search node. Handles are opaque; one is live per node until dropped.

    Implementations: `SharedKV` (ArborKV-style branch-aware cache, our design) and `CopiedKV` (baseline).
    """

    def start(self, model, prompt: Int[Tensor, "1 L"]) -> Any:
        """Prefill the prompt (all but its last token, which the first step feeds) and return the root's handle."""
        raise NotImplementedError  # pragma: no cover - abstract

    def fork(self, handle: Any) -> Any:
        """A new handle whose KV equals `handle`'s."""
        raise NotImplementedError  # pragma: no cover - abstract

    def cache(self, handle: Any):
        """The transformers `Cache` to decode `handle`'s branch with (makes it the active branch)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def drop(self, handle: Any) -> None:
        """Free what only `handle` held."""
        raise NotImplementedError  # pragma: no cover - abstract

    def after_step(self) -> None:
        """Called after each step (memory bookkeeping)."""

    def set_value(self, handle: Any, value: float) -> None:
        """The search's value estimate of a handle's path (called after each step; default: ignored)."""

    def memory(self) -> dict[str, int]:
        """Bytes: at least 'peak_device' (peak KV bytes on the compute device) and 'device' (now)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def close(self) -> None:
        """Release everything."""


class SharedKV(Backend):
    """Branches in one `BranchCache` (shared prefixes stored once; ArborKV-style tree-aware compression).

    ArborKV (abstract only): the active path gets budget priority, inactive subtrees keep a subset of their
    tokens, revisits rehydrate lazily. The mechanism (segment tree, compression of the lowest-value inactive
    nodes first, host tier, recomputation or resumption from the kept subset) is ours; see `kvcompose.branch`.
    Handles are `BranchCache` branch ids; the search's path values reach the cache through `set_value`.

    Args:
        **cache_kwargs: passed to `BranchCache` (budget, keep, min_keep, scorer, tier, rehydrate, priority,
            active_budget, host_limit, seed).
    """

    def __init__(self, **cache_kwargs):
        self.cache_kwargs = cache_kwargs
        self.branch_cache = None
        self._root_used = False

    def start(self, model, prompt):
        from .branch import BranchCache

        self.close()
        self.branch_cache = BranchCache(model, **self.cache_kwargs)
        if prompt.shape[1] > 1:
            with torch.no_grad():
                model(input_ids=prompt[:, :-1], past_key_values=self.branch_cache, use_cache=True)
        return 0

    def fork(self, handle):
        return self.branch_cache.fork(handle)

    def cache(self, handle):
        self.branch_cache.switch(handle)
        return self.branch_cache

    def set_value(self, handle, value):
        if math.isfinite(value) or value == -math.inf:
            self.branch_cache.set_value(handle, value)

    def drop(self, handle):
        c = self.branch_cache
        if handle == c.active:  # the active branch cannot be dropped: park on another live branch first
            others = [b for b in c.branches if b != handle]
            if not others:
                return
            c.switch(others[0])
        c.drop(handle)

    def memory(self):
        m = self.branch_cache.memory()
        return {
            "device": m.device, "held": m.held, "host": m.host, "peak_device": m.peak_device,
            "peak_held": m.peak_held, "peak_host": m.peak_host, "peak_total": m.peak_total,
            "unique_tokens": m.unique_tokens, "copy_tokens": m.copy_tokens,
            "compressions": self.branch_cache.compressions,
            "rehydrated_host": self.branch_cache.rehydrations["host"],
            "recomputed": self.branch_cache.rehydrations["recomputed"],
            "recomputed_tokens": self.branch_cache.rehydrations["recomputed_tokens"],
            "resumed": self.branch_cache.rehydrations["resumed"],
        }

    def close(self):
        if self.branch_cache is not None:
            self.branch_cache.close()
            self.branch_cache = None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.cache_kwargs.items())
        return f"SharedKV({args})"


def _cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


class CopiedKV(Backend):
    """The naive baseline: one `DynamicCache` per branch, a deep copy of the parent's at every fork.

    This is what ArborKV's ~4x peak-memory reduction is measured against (per-branch full KV). Each
    branch holds `[1, H, L, D]` keys and values per layer for its whole path `L`.

    Args:
        attn_implementation: attention implementation to set on the model at `start` (e.g. "sdpa", stock
            transformers); None leaves the model as it is.
    """

    def __init__(self, attn_implementation: str | None = "sdpa"):
        self.attn_implementation = attn_implementation
        self.caches: dict[int, Any] = {}
        self._next = 0
        self._peak = 0

    def start(self, model, prompt):
        from transformers import DynamicCache

        if self.attn_implementation is not None and model.config._attn_implementation != self.attn_implementation:
            model.set_attn_implementation(self.attn_implementation)
        self.caches, self._next, self._peak = {}, 0, 0
        cache = DynamicCache(config=model.config)
        if prompt.shape[1] > 1:
            with torch.no_grad():
                model(input_ids=prompt[:, :-1], past_key_values=cache, use_cache=True)
        return self._add(cache)

    def _add(self, cache) -> int:
        h = self._next
        self._next += 1
        self.caches[h] = cache
        self.after_step()
        return h

    def fork(self, handle):
        if handle not in self.caches:
            raise KVComposeError(f"CopiedKV: no live branch {handle}")
        return self._add(copy.deepcopy(self.caches[handle]))

    def cache(self, handle):
        if handle not in self.caches:
            raise KVComposeError(f"CopiedKV: no live branch {handle}")
        return self.caches[handle]

    def drop(self, handle):
        self.caches.pop(handle, None)

    def _bytes(self) -> int:
        return sum(_cache_bytes(c) for c in self.caches.values())

    def after_step(self) -> None:
        self._peak = max(self._peak, self._bytes())

    def memory(self):
        now = self._bytes()
        return {"device": now, "held": now, "host": 0, "peak_device": self._peak, "peak_held": self._peak,
                "peak_host": 0, "peak_total": self._peak}

    def close(self):
        self.caches = {}

    def __repr__(self) -> str:
        return f"CopiedKV(attn_implementation={self.attn_implementation!r})"


# ------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------
_DELIMITER_IDS: dict[tuple[int, str], Tensor] = {}


def delimiter_token_ids(tokenizer, delimiter: str) -> Int[Tensor, " K"]:
    """Ids of every vocabulary token whose text contains `delimiter` (cached per tokenizer)."""
    key = (id(tokenizer), delimiter)
    if key not in _DELIMITER_IDS:
        n = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(n)])
        ids = [i for i, t in enumerate(texts) if delimiter in t]
        if not ids:
            raise KVComposeError(f"no token of the vocabulary contains the delimiter {delimiter!r}")
        _DELIMITER_IDS[key] = torch.tensor(ids, dtype=torch.long)
    return _DELIMITER_IDS[key]


def _stopping_criteria(stop_ids: Tensor, start: int, min_tokens: int):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _StepEnd(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = torch.isin(input_ids[:, -1], stop_ids.to(input_ids.device))
            return done & (input_ids.shape[1] - start >= min_tokens)

    return StoppingCriteriaList([_StepEnd()])


_AGGREGATES: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda s: sum(s) / len(s),
    "sum": sum,
    "min": min,
    "last": lambda s: s[-1],
}


class TreeSearch:
    """Tree search over reasoning steps with any Hugging Face causal LM.

    Tree of Thoughts (Yao et al., arXiv 2305.10601) BFS or best-first search; the KV of the branches lives
    in a `Backend` (ArborKV-style `SharedKV` by default; ArborKV is abstract-only, the driver is ours).
    Prompts are `[1, L]` token ids; each step is decoded with `model.generate` on the active branch.

    Example:
        >>> search = TreeSearch(model, tok, backend=SharedKV(budget=512), width=4, expand=2, depth=4)
        >>> result = search.run(chat_inputs(tok, question)["input_ids"])
        >>> print(tok.decode(result.best_tokens()), result.memory["peak_device"])

    Args:
        model: a Hugging Face causal LM.
        tokenizer: needed for a text delimiter and for step texts (None: token-count steps only).
        backend: `SharedKV(...)` (default) / `CopiedKV()`, or "shared" / "copies".
        strategy: "bfs" (Tree-of-Thoughts BFS, a step-level beam) or "best_first" (backtracking).
        width: BFS frontier size; best-first keeps at most `width * expand` open nodes.
        expand: sampled steps per expanded node.
        root_expand: sampled steps from the root (default: `width`).
        depth: maximum steps per path.
        step_tokens: maximum tokens per step.
        min_step_tokens: a delimiter does not end a shorter step.
        delimiter: the text that ends a step (e.g. "\\n"); None: steps of exactly `step_tokens` tokens.
        stop_token_ids: token ids that end a step, instead of `delimiter`.
        scorer: values each step (a `StepScorer` or any callable `Step -> float`; default `MeanLogProb()`).
        aggregate: a path's value from its steps' scores: "mean", "sum", "min" or "last".
        temperature: sampling temperature (0 = greedy, only with expand = root_expand = 1).
        top_k: top-k sampling (None: off).
        top_p: nucleus sampling (None: off).
        seed: base seed; each node's step is sampled from `seed` and the node's id.
        max_expansions: best-first: number of expansions (default `depth * width`).
        eos_token_id: ends the answer (default: the model's generation config).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        backend: Backend | Literal["shared", "copies"] = "shared",
        strategy: Literal["bfs", "best_first"] = "bfs",
        width: int = 4,
        expand: int = 2,
        root_expand: int | None = None,
        depth: int = 4,
        step_tokens: int = 64,
        min_step_tokens: int = 1,
        delimiter: str | None = "\n",
        stop_token_ids: list[int] | None = None,
        scorer: StepScorer | Callable[[Step], float] | None = None,
        aggregate: Literal["mean", "sum", "min", "last"] = "mean",
        temperature: float = 0.7,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        max_expansions: int | None = None,
        eos_token_id: int | list[int] | None = None,
    ):
        for name, v in (("width", width), ("expand", expand), ("depth", depth), ("step_tokens", step_tokens),
                        ("min_step_tokens", min_step_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KVComposeError(f"{name} must be a positive int, got {v!r}")
        root_expand = width if root_expand is None else root_expand
        if isinstance(root_expand, bool) or not isinstance(root_expand, int) or root_expand < 1:
            raise KVComposeError(f"root_expand must be a positive int, got {root_expand!r}")
        if strategy not in ("bfs", "best_first"):
            raise KVComposeError(f"strategy must be 'bfs' or 'best_first', got {strategy!r}")
        if aggregate not in _AGGREGATES:
            raise KVComposeError(f"aggregate must be one of {sorted(_AGGREGATES)}, got {aggregate!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise KVComposeError(f"temperature must be >= 0, got {temperature!r}")
        if temperature == 0 and max(expand, root_expand) > 1:
            raise KVComposeError("greedy steps (temperature 0) make identical siblings; use temperature > 0 or expand=1")
        if backend == "shared":
            backend = SharedKV()
        elif backend == "copies":
            backend = CopiedKV()
        if not isinstance(backend, Backend):
            raise KVComposeError(f"backend must be SharedKV(...), CopiedKV(), 'shared' or 'copies', got {backend!r}")
        if scorer is None:
            scorer = MeanLogProb()
        if not callable(scorer):
            raise KVComposeError(f"scorer must be a StepScorer or a callable Step -> float, got {scorer!r}")
        if stop_token_ids is not None:
            stop = torch.tensor(list(stop_token_ids), dtype=torch.long)
        elif delimiter is not None:
            if tokenizer is None:
                raise KVComposeError("a text delimiter needs a tokenizer (or pass stop_token_ids, or delimiter=None)")
            stop = delimiter_token_ids(tokenizer, delimiter)
        else:
            stop = None
        if eos_token_id is None:
            eos_token_id = getattr(model.generation_config, "eos_token_id", None)
        eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        self.model, self.tokenizer, self.backend, self.strategy = model, tokenizer, backend, strategy
        self.width, self.expand, self.root_expand, self.depth = width, expand, root_expand, depth
        self.step_tokens, self.min_step_tokens, self.stop_ids = step_tokens, min_step_tokens, stop
        self.scorer, self.aggregate = scorer, aggregate
        self.temperature, self.top_k, self.top_p, self.seed = float(temperature), top_k, top_p, seed
        self.max_expansions = depth * width if max_expansions is None else max_expansions
        self.eos = torch.tensor(eos, dtype=torch.long)

    # -- one step -----------------------------------------------------------------------------------
    def _generation_config(self):
        from transformers import GenerationConfig

        gc = self.model.generation_config
        pad = gc.pad_token_id if gc.pad_token_id is not None else (self.eos[0].item() if self.eos.numel() else 0)
        sample = self.temperature > 0
        kw: dict[str, Any] = dict(
            max_new_tokens=self.step_tokens, do_sample=sample, return_dict_in_generate=True, output_logits=True,
            eos_token_id=self.eos.tolist() or None, pad_token_id=pad, bos_token_id=gc.bos_token_id,
        )
        if sample:
            kw.update(temperature=self.temperature, top_k=self.top_k if self.top_k is not None else 0,
                      top_p=self.top_p if self.top_p is not None else 1.0)
        return GenerationConfig(**kw)

    def _step(self, parent: SearchNode, handle: Any, node_id: int) -> SearchNode:
        cache = self.backend.cache(handle)
        ids = parent.tokens
        dev = self.model.device
        start = ids.shape[1]
        criteria = _stopping_criteria(self.stop_ids, start, self.min_step_tokens) if self.stop_ids is not None else None
        devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(self.seed * 1_000_003 + node_id)
            out = self.model.generate(
                input_ids=ids.to(dev), attention_mask=torch.ones_like(ids, device=dev), past_key_values=cache,
                generation_config=self._generation_config(), stopping_criteria=criteria,
            )
        self.backend.after_step()
        new = out.sequences[0, start:].cpu()
        logits = torch.stack(out.logits, dim=1)[0, : new.shape[0]].float().cpu()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, new[:, None])[:, 0]
        finished = bool(torch.isin(new, self.eos).any()) if self.eos.numel() else False
        if finished:  # cut after the first end-of-sequence token (generate pads a finished row)
            cut = int(torch.isin(new, self.eos).nonzero()[0, 0]) + 1
            new, lp = new[:cut], lp[:cut]
        text = self.tokenizer.decode(new) if self.tokenizer is not None else None
        step = Step(token_ids=new, logprobs=lp, text=text, depth=parent.depth + 1, finished=finished)
        score = float(self.scorer(step))
        path_scores = [n.score for n in _ancestry(parent) if n.step is not None] + [score]
        value = _AGGREGATES[self.aggregate](path_scores)
        finished = finished or parent.depth + 1 >= self.depth
        tokens = torch.cat([ids, new[None]], dim=1)
        self._generated += new.shape[0]
        self.backend.set_value(handle, value)  # the cache compresses the lowest-value inactive branches first
        return SearchNode(id=node_id, parent=parent, depth=parent.depth + 1, step=step, score=score, value=value,
                          tokens=tokens, finished=finished, handle=handle)

    def _expand(self, node: SearchNode, k: int) -> list[SearchNode]:
        children = []
        for _ in range(k):
            h = self.backend.fork(node.handle)
            child = self._step(node, h, len(self._nodes))
            self._nodes.append(child)
            children.append(child)
        self._release(node)
        return children

    def _release(self, node: SearchNode) -> None:
        if node.handle is not None:
            self.backend.drop(node.handle)
            node.handle = None

    # -- the searches -------------------------------------------------------------------------------
    def run(self, input_ids: Int[Tensor, "1 L"]) -> SearchResult:
        """Search from a prompt `[1, L]` (token ids, e.g. `chat_inputs(tok, question)["input_ids"]`)."""
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise KVComposeError("input_ids must be a [1, L] tensor of token ids (one prompt; branches are the batch)")
        if input_ids.shape[1] < 1:
            raise KVComposeError("the prompt is empty")
        prompt = input_ids.detach().cpu().long()
        t0 = time.perf_counter()
        self._nodes: list[SearchNode] = []
        self._generated = 0
        root = SearchNode(id=0, parent=None, depth=0, step=None, score=0.0, value=0.0, tokens=prompt)
        self._nodes.append(root)
        root.handle = self.backend.start(self.model, prompt.to(self.model.device))
        if self.strategy == "bfs":
            frontier, decisions = self._bfs(root)
        else:
            frontier, decisions = self._best_first(root)
        best = max(frontier, key=lambda n: (n.finished, n.value, -n.id))
        memory = self.backend.memory()
        wall = time.perf_counter() - t0
        return SearchResult(best=best, frontier=frontier, nodes=list(self._nodes), decisions=decisions,
                            prompt_length=prompt.shape[1], generated_tokens=self._generated, wall_s=wall, memory=memory)

    def _bfs(self, root: SearchNode) -> tuple[list[SearchNode], list[list[int]]]:
        frontier, decisions = [root], []
        for _ in range(self.depth):
            candidates: list[SearchNode] = []
            for node in frontier:
                if node.finished:
                    candidates.append(node)
                else:
                    candidates += self._expand(node, self.root_expand if node is root else self.expand)
            ranked = sorted(candidates, key=lambda n: (-n.value, n.id))
            keep = ranked[: self.width]
            for n in ranked[self.width:]:
                self._release(n)
            frontier = sorted(keep, key=lambda n: n.id)
            decisions.append([n.id for n in frontier])
            if all(n.finished for n in frontier):
                break
        return frontier, decisions

    def _best_first(self, root: SearchNode) -> tuple[list[SearchNode], list[list[int]]]:
        open_nodes, done, decisions = [root], [], []
        max_open = self.width * self.expand
        for _ in range(self.max_expansions):
            if not open_nodes:
                break
            node = open_nodes.pop(0)  # kept sorted: the best open node
            decisions.append([node.id])
            children = self._expand(node, self.root_expand if node is root else self.expand)
            for c in children:
                (done if c.finished else open_nodes).append(c)
            open_nodes.sort(key=lambda n: (-n.value, n.id))
            for n in open_nodes[max_open:]:
                self._release(n)
            open_nodes = open_nodes[:max_open]
            if done and max(d.value for d in done) >= max((n.value for n in open_nodes), default=-math.inf):
                break
        return (open_nodes + done) or [root], decisions


def _ancestry(node: SearchNode) -> list[SearchNode]:
    out = []
    while node is not None:
        out.append(node)
        node = node.parent
    return out[::-1]
