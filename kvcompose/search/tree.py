"""The search driver, `TreeSearch`: Tree-of-Thoughts BFS or best-first search over reasoning steps decoded
with `model.generate` on the active branch of a `Backend`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from ..seeding import check_seed, derived_seed
from ..view import KVComposeError
from .backends import Backend, CopiedKV, SharedKV
from .nodes import MeanLogProb, SearchNode, SearchResult, Step, StepScorer

__all__ = ["TreeSearch", "delimiter_token_ids"]


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
        self.temperature, self.top_k, self.top_p = float(temperature), top_k, top_p
        self.seed = check_seed(seed, "seed")
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
            torch.manual_seed(derived_seed(self.seed, node_id))
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
