"""A tiny random chat model with a character-level tokenizer and a ChatML template, for tests, examples and
docs that must run in seconds without the real model. Its text is gibberish; the code paths are real."""

from __future__ import annotations

import os
import string

import torch

__all__ = ["tiny_chat_model", "save_tiny_chat_model", "CHATML_TEMPLATE"]

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]


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
    from ..models import tiny_model

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
