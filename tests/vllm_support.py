"""Helpers of the vLLM tests (tests/test_vllm_*.py): the models they serve and the `KVComposeCache` reference
they are held to. Nothing here imports vLLM."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from kvcompose import KVComposeCache, Pipeline, TopK, methods


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
        events: the tokens seen by layer 0 after each of its compression events.
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


@torch.no_grad()
def reference(model, prompt: list[int], tokens: list[int], preset: str, budget: int | None, interval: int,
              seed: int, args: dict | None = None) -> Reference:
    """Feed `prompt`, then `tokens` one at a time, through `KVComposeCache` with the preset (as `generate`
    would, greedy or not: the next token is the given one) and return the logprobs and the event counts."""
    pipe = methods.PRESETS[preset](**(args or {}))
    pipe.__class__ = _Recording  # this object only
    pipe.gaps = []
    cache = KVComposeCache(model, pipe, budget=budget if pipe.compresses else None, interval=interval, seed=seed)
    out = []
    events, gaps = [], []
    ids = torch.tensor([prompt])
    for i in range(len(tokens)):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
        out.append(torch.log_softmax(logits, -1))
        layer = cache.layers[0]
        if len(events) < layer.events:
            events.append(layer.seen)
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
