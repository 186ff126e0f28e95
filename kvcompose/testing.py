"""Tiny randomly initialised models for tests, examples and docs that must run in seconds without the real
model (and without a model hub): `tiny_model` (any of the supported architectures) and `tiny_chat_model`
(with a character-level tokenizer and a ChatML template, usable as `--model DIR` on the command line), and
`TINY_PRESETS`, every preset scaled down so that such a model compresses within a few dozen tokens, and
`greedy_steps`, a greedy decode one forward per token (what the exactness checks compare).
Their text is gibberish; the code paths are real."""

from __future__ import annotations

import os
import string

import torch

from .view import KVComposeError

__all__ = ["tiny_model", "tiny_chat_model", "save_tiny_chat_model", "CHATML_TEMPLATE", "ARCHS", "TINY_PRESETS", "greedy_steps"]

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def tiny_model(arch: str = "llama", *, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               vocab: int = 128, seed: int = 0, dtype: torch.dtype = torch.float32, init_std: float = 0.2,
               attn_implementation: str = "sdpa"):
    """A small randomly initialised causal LM of one of the supported architectures.

    `init_std` is larger than usual so that logits are peaked and greedy decoding is stable under the
    float noise of different (but equivalent) attention kernels.
    """
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
        Qwen3Config, Qwen3ForCausalLM,
    )

    table = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": head_dim}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    }
    if arch not in table:
        raise KVComposeError(f"unknown architecture {arch!r}; choose one of {sorted(table)}")
    cfg_cls, model_cls, extra = table[arch]
    cfg = cfg_cls(
        vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, initializer_range=init_std, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=None, pad_token_id=0, **extra,
    )
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  unk_token="<unk>", pad_token="<|im_end|>",
                                  additional_special_tokens=["<|endoftext|>"])
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_chat_model(arch: str = "llama", layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32):
    """`(model, tokenizer)`: a random `tiny_model` (vocab 128) whose end-of-sequence id is 2 (`<|im_end|>`),
    with a character-level tokenizer and a ChatML chat template like SmolLM2's."""
    tok = _tokenizer()
    model = tiny_model(arch, layers=layers, vocab=128, seed=seed, dtype=dtype, init_std=0.05)
    model.config.eos_token_id = 2
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    model.generation_config.bos_token_id = 1
    return model, tok


def save_tiny_chat_model(path: str | os.PathLike, **kwargs) -> str:
    """Save `tiny_chat_model(**kwargs)` as a Hugging Face model directory (usable as `--model path`)."""
    model, tok = tiny_chat_model(**kwargs)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _tiny_presets() -> dict:
    from . import methods

    return {
        "full": lambda: methods.full(),
        "streaming_llm": lambda: methods.streaming_llm(sinks=2),
        "h2o": lambda: methods.h2o(),
        "snapkv": lambda: methods.snapkv(window=4, kernel=3),
        "tova": lambda: methods.tova(),
        "knorm": lambda: methods.knorm(sinks=2),
        "rkv": lambda: methods.rkv(window=2, kernel=3),
        "random_attention": lambda: methods.random_attention(recent=4),
        "vase": lambda: methods.vase(recent=4, window=8, kernel=3),
        "vase_query_free": lambda: methods.vase(recent=4, query_free=True, rank=4),
        "memory_hierarchy": lambda: methods.memory_hierarchy(0.5, 0.2, 0.1, recent=4),
        "pyramid_rkv": lambda: methods.pyramid_rkv(methods.rkv(window=2, kernel=3), beta=2),
        "reason_alloc": lambda: methods.reason_alloc(methods.rkv(window=2, kernel=3), profile=None, window=4,
                                                     page_size=4, floor=0.5),
        "growpage": lambda: methods.growpage(methods.rkv(window=2, kernel=3), page=4, window=4, initial=0.5),
    }


TINY_PRESETS = _tiny_presets()
"""name -> a builder of that preset (each one of `methods.PRESETS`, plus VaSE's query-free variant) with windows
small enough for budgets of 16-24 tokens: the cases of the exactness properties and of `benchmarks/crop_census.py`."""


@torch.no_grad()
def greedy_steps(model, cache, first: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode `n` tokens greedily through `cache` after feeding `first` (`[B, 1]`), one forward per token:
    (tokens `[B, n]`, logits `[B, n, vocab]`)."""
    toks, logits = [], []
    x = first
    for _ in range(n):
        lg = model(input_ids=x, past_key_values=cache).logits[:, -1]
        x = lg.argmax(-1, keepdim=True)
        toks.append(x)
        logits.append(lg)
    return torch.cat(toks, 1), torch.stack(logits, 1)
